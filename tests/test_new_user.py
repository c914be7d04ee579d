"""What a new user meets first: one CPU device by mistake, a call made
too late, a HuggingFace config, warnings that must point at the user's
line, and ``describe()`` telling the truth about them."""

import json
import os
import shutil
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import zero_jax as zj
from tests import _models as m
from zero_jax.checkpoint import _last_checkpoint

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------- one CPU device


def test_describe_on_one_device_says_nothing_is_sharded():
  engine = zj.Engine(m.mlp_loss, optax.sgd(0.1),
                     zj.ZeroConfig(stage=3, min_shard_elements=0,
                                   grad_accum_steps=2),
                     zj.make_mesh(num_devices=1))
  engine.init(m.mlp_params())
  text = engine.describe()
  assert "1 device on 'data', so nothing is sharded" in text
  assert "simulate_cpu_devices" in text
  assert "sharded dim" not in text and "per device" not in text, text
  assert "not sharded (one device on 'data'): (64, 64)" in text
  # No clipping is said so, not "clip to global norm None".
  assert "clipping: none" in text and "norm None" not in text


def test_describe_on_several_devices_says_which_dim_is_sharded():
  engine = zj.Engine(m.mlp_loss, optax.sgd(0.1),
                     zj.ZeroConfig(stage=3, min_shard_elements=0,
                                   clip_grad_norm=1.0),
                     zj.make_mesh(num_devices=8))
  engine.init(m.mlp_params())
  text = engine.describe()
  assert "nothing is sharded" not in text
  assert "sharded dim 1 -> (64, 8) per device" in text
  assert "clipping: to global norm 1" in text


def _run(code: str, **env) -> subprocess.CompletedProcess:
  """``code`` in a new Python process on CPU with JAX's default device
  count (the tests' 8 devices not forced)."""
  base = {k: v for k, v in os.environ.items()
          if not k.startswith(("XLA_", "ZERO_JAX_", "PYTEST_"))}
  return subprocess.run(
      [sys.executable, "-c", code], cwd=_ROOT, capture_output=True,
      text=True, timeout=120,
      env=dict(base, PYTHONPATH=_ROOT, JAX_PLATFORMS="cpu", **env))


def test_make_mesh_warns_of_one_cpu_device_naming_simulate():
  out = _run(
      "import json, warnings\n"
      "import zero_jax as zj\n"
      "with warnings.catch_warnings(record=True) as w:\n"
      "  warnings.simplefilter('always')\n"
      "  zj.make_mesh()\n"
      "  zj.make_mesh(num_devices=1)  # one device on purpose: no warning\n"
      "print(json.dumps([(str(x.message), x.filename, x.lineno) "
      "for x in w]))\n")
  assert out.returncode == 0, out.stderr
  warned = json.loads(out.stdout.splitlines()[-1])
  if (os.cpu_count() or 1) < 2:
    # (One core: one CPU device is all there is, nothing to warn of.)
    assert not warned, warned
    return
  [(message, filename, line)] = warned
  assert "zero_jax.simulate_cpu_devices(n)" in message
  assert "before JAX starts" in message
  assert (filename, line) == ("<string>", 5)  # the user's line


def test_make_mesh_on_the_suites_devices_does_not_warn():
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    zj.make_mesh()
    zj.make_mesh(num_devices=1)
  assert not [w for w in caught if "simulate_cpu_devices" in str(
      w.message)], [str(w.message) for w in caught]


def test_simulate_cpu_devices_too_late_is_zero_jaxs_error(monkeypatch):
  # (The suite's XLA_FLAGS ask for 8 devices, which the call respects: as
  # a user's script without them, JAX having started.)
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.delenv("ZERO_JAX_CPU_DEVICES", raising=False)
  assert len(jax.devices("cpu")) == 8
  with pytest.raises(RuntimeError) as info:
    zj.simulate_cpu_devices(4)
  message = str(info.value)
  assert "came too late: JAX has started already, with 8 CPU" in message
  assert "Call it first thing" in message
  assert "jax_num_cpu_devices" not in message
  zj.simulate_cpu_devices(8)  # what there is already: nothing to do
  assert len(jax.devices("cpu")) == 8


# --------------------------------------------- a HuggingFace config


_HF_CONFIG = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {
        "lr": "auto", "betas": "auto", "eps": "auto",
        "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto",
        "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3}}


def test_from_deepspeed_names_initialize_for_autos_and_sections_at_once():
  with pytest.raises(ValueError) as info:
    zj.from_deepspeed(_HF_CONFIG)
  message = str(info.value)
  head, *lines = message.splitlines()
  assert "'optimizer' and 'scheduler' sections" in head
  assert "zj.initialize(loss_fn, params, config, **keywords)" in head
  # Every "auto", the sections' too, each with its keyword(s), one a line.
  for line in lines:
    assert line.startswith("  '") and line.endswith(
        ", or replace 'auto' with a value"), line
  expected = {
      "'train_batch_size'": "pass per_device_train_batch_size=... and "
                            "gradient_accumulation_steps=... (",
      "'optimizer.params.betas'": "pass adam_beta1=... and adam_beta2=...,",
      "'scheduler.params.warmup_num_steps'":
          "pass warmup_steps=... (or warmup_ratio=... with max_steps=...),",
      "'optimizer.params.lr'": "pass learning_rate=...,"}
  for key, how in expected.items():
    (line,) = [l for l in lines if l.startswith(f"  {key}:")]
    assert how in line, line
  # No keyword ends in "...)=...", as a parenthesis once did.
  assert ")=" not in message
  # The same keywords then make zj.initialize build all of it.
  engine, _ = zj.initialize(
      m.mlp_loss, m.mlp_params(), _HF_CONFIG,
      zj.make_mesh(num_devices=8), per_device_train_batch_size=4,
      gradient_accumulation_steps=1, max_grad_norm=1.0, bf16=False,
      learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.999,
      adam_epsilon=1e-8, weight_decay=0.0, warmup_steps=10)
  assert engine.train_batch_size == 32


def test_a_config_without_sections_does_not_name_initialize():
  with pytest.raises(ValueError) as info:
    zj.from_deepspeed({"gradient_clipping": "auto"})
  assert "initialize" not in str(info.value)
  assert "'gradient_clipping': pass max_grad_norm=..." in str(info.value)


# ------------------------------------------- warnings at the user's line


def _where(caught) -> list[tuple[str, str]]:
  return [(os.path.basename(w.filename), str(w.message)[:60])
          for w in caught]


def test_from_deepspeeds_warnings_point_at_the_callers_line():
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    zj.from_deepspeed({"zero_optimization": {
        "stage": 2, "reduce_bucket_size": 5e8}, "steps_per_print": 10})
    zj.config.read_deepspeed({"zero_optimization": {
        "stage": 3, "cpu_offload": True}})
  assert len(caught) >= 2, _where(caught)
  assert all(w.filename == __file__ for w in caught), _where(caught)


def test_initializes_warnings_point_at_the_callers_line():
  # A key without effect (the config reader's), and OneCycle's momentum
  # cycle with SGD (the optimizer builder's, three calls down).
  config = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "scheduler": {"type": "OneCycle", "params": {
                "cycle_min_lr": 0.001, "cycle_max_lr": 0.01,
                "cycle_first_step_size": 3, "cycle_momentum": True}}}
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    zj.initialize(m.mlp_loss, m.mlp_params(), config,
                  zj.make_mesh(num_devices=8))
  texts = [str(w.message) for w in caught]
  assert any("reduce_bucket_size" in t for t in texts), texts
  assert any("cycle_momentum" in t for t in texts), texts
  assert all(w.filename == __file__ for w in caught), _where(caught)


def test_initializes_warnings_follow_the_callers_filters():
  config = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    with pytest.raises(UserWarning, match="reduce_bucket_size"):
      zj.initialize(m.mlp_loss, m.mlp_params(), config,
                    zj.make_mesh(num_devices=8), tx=optax.sgd(0.1))


# ------------------------------------------- prefetch and loop models


def _loop_params(blocks=3):
  return {"blocks": [{"dense": {"w": jnp.ones((64, 64)) * 0.1,
                                "b": jnp.zeros((64,))}}
                     for _ in range(blocks)],
          "out": jnp.ones((64, 8))}


def _loop_loss(params, batch):
  x = batch["x"]
  for block in params["blocks"]:
    x = jnp.tanh(x @ block["dense"]["w"] + block["dense"]["b"])
  return jnp.mean((x @ params["out"]) ** 2)


def test_prefetch_line_is_true_of_a_model_of_blocks_in_a_loop():
  engine = zj.Engine(_loop_loss, optax.sgd(0.1),
                     zj.ZeroConfig(stage=3, min_shard_elements=0),
                     zj.make_mesh(num_devices=8))
  engine.abstract_state(jax.eval_shape(_loop_params))
  (line,) = [l for l in engine.describe().splitlines()
             if l.startswith("prefetch (auto): ")]
  assert "scanned layer" not in line
  assert "each layer that zero_jax.layers.scan_layers runs" in line
  assert ("the 3 repeated blocks (blocks/0 ...), called one by one, are "
          "gathered at their call") in line


# ------------------------------------ the checkpoint a failed step names


def test_a_removed_checkpoint_directory_is_no_longer_named(tmp_path):
  # (_last_checkpoint: the record a failed step's error names, to resume
  # from.)
  engine = zj.Engine(m.mlp_loss, optax.sgd(0.1),
                     zj.ZeroConfig(stage=3, min_shard_elements=0),
                     zj.make_mesh(num_devices=8))
  state = engine.init(m.mlp_params())
  kept, gone = str(tmp_path / "kept"), str(tmp_path / "gone")
  with zj.Checkpointer(kept, async_save=False) as ckpt:
    ckpt.save(state)
  assert repr(kept) in _last_checkpoint.restore_hint()
  ckpt = zj.Checkpointer(gone, async_save=False)
  ckpt.save(state)
  ckpt.wait()  # (committed: recorded)
  assert repr(gone) in _last_checkpoint.restore_hint()
  # Its checkpoints removed (a notebook starting over), then closed: the
  # hint no longer sends the user there.
  shutil.rmtree(gone)
  ckpt.close()
  assert _last_checkpoint.last() is None
  # Closing a directory whose checkpoint is there keeps it named.
  with zj.Checkpointer(kept, read_only=True) as ckpt:
    ckpt.restore(engine, m.mlp_params())
  assert repr(kept) in _last_checkpoint.restore_hint()


def test_an_export_is_replaced_only_when_asked_and_only_an_export(tmp_path):
  engine = zj.Engine(m.mlp_loss, optax.sgd(0.1),
                     zj.ZeroConfig(stage=3, min_shard_elements=0),
                     zj.make_mesh(num_devices=8))
  params = m.mlp_params()
  state = engine.init(params)
  out = str(tmp_path / "out")
  zj.export_params(engine, state, out)
  # A script run again: the message names the fix.
  with pytest.raises(FileExistsError, match="overwrite=True"):
    zj.export_params(engine, state, out)
  state, _ = engine.step(state, m.mlp_batches(1)[0])
  zj.export_params(engine, state, out, overwrite=True)
  loaded = zj.load_params(out, engine, params)
  for a, b in zip(jax.tree.leaves(loaded),
                  jax.tree.leaves(engine.gather_params(state))):
    assert (jax.device_get(a) == jax.device_get(b)).all()
  # Anything but an earlier export is never replaced.
  other = tmp_path / "notes"
  other.mkdir()
  (other / "keep.txt").write_text("mine")
  with pytest.raises(FileExistsError, match="no orbax checkpoint"):
    zj.export_params(engine, state, str(other), overwrite=True)
  assert (other / "keep.txt").read_text() == "mine"
