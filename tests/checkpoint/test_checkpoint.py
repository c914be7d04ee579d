"""Checkpoints restore into any stage, device count and offload setting."""

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import zero_jax as zj
from tests import _models as m

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
TX = optax.adamw(1e-2)
BATCHES = m.mlp_batches(10)
OFFLOAD = {"offload_optimizer": "host", "offload_params": "host"}


@functools.cache
def _engine(stage, devices=8, tx=TX, loss=m.mlp_loss, **overrides):
  """One engine per configuration, shared by the tests that train or
  restore with it (an engine holds no training state: its steps are traced
  and compiled once in the file)."""
  config = zj.ZeroConfig(stage=stage, min_shard_elements=0, **overrides)
  return zj.Engine(loss, tx, config, zj.make_mesh(devices))


def _worker(devices, *args, **kwargs):
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  return subprocess.Popen(
      [sys.executable, "-m", "tests.checkpoint._checkpoint_worker",
       str(devices), *map(str, args)], cwd=ROOT, env=env,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """5 steps at stage 3 on 8 devices, saved without offload, with offload,
  and with the update on the host; and the uninterrupted 10-step run."""
  root = tmp_path_factory.mktemp("ckpt")
  dirs, first = {}, {}
  for name, overrides in (("plain", {}), ("offload", OFFLOAD),
                          ("host", dict(OFFLOAD, update_on="host"))):
    engine = _engine(3, **overrides)
    state, first[name] = m.run_steps(engine, engine.init(m.mlp_params()),
                                BATCHES[:5])
    dirs[name] = str(root / name)
    with zj.Checkpointer(dirs[name]) as ckpt:
      ckpt.save(state, engine=engine)
  engine = _engine(3)
  state, losses = m.run_steps(engine, engine.init(m.mlp_params()), BATCHES)
  assert first["plain"] == first["offload"] == first["host"] == losses[:5]
  return dirs, losses, engine.gather_params(state)


def _assert_uninterrupted(losses, params, saved):
  _, ref_losses, ref_params = saved
  m.assert_matches(saved[1][:5] + list(losses), params, ref_losses,
                   {k: np.asarray(v) for k, v in ref_params.items()})


# Which checkpoint restores into which config: every offload combination.
JOBS_4 = [("plain", 1, {}), ("offload", 1, {}),
          ("plain", 1, {"offload_optimizer": "host"})]
JOBS_1 = [("host", 0, {}), ("offload", 0, {}), ("plain", 3, OFFLOAD),
          ("offload", 2, {"offload_optimizer": "host", "update_on": "host"})]


def test_restore_at_stage_1_on_4_devices_in_another_process(saved, tmp_path):
  dirs = saved[0]
  spec = tmp_path / "spec.json"
  spec.write_text(json.dumps([{"dir": dirs[d], "stage": s, "config": c}
                              for d, s, c in JOBS_4]))
  out = tmp_path / "out.npz"
  proc = _worker(4, "resume", spec, out)
  log = proc.communicate(timeout=240)[0]
  assert proc.returncode == 0, log[-3000:]
  result = np.load(out)
  for i in range(len(JOBS_4)):
    params = {k: result[f"{i}/{k}"] for k in m.mlp_params()}
    _assert_uninterrupted(result[f"{i}/losses"], params, saved)


@pytest.mark.parametrize("name,stage,overrides", JOBS_1)
def test_restore_on_1_device(saved, name, stage, overrides):
  engine = _engine(stage, devices=1, **overrides)
  with zj.Checkpointer(saved[0][name]) as ckpt:
    state = ckpt.restore(engine, m.mlp_params())
  assert int(state.step) == 5
  # The restored state has this engine's layout, memory kinds included.
  for leaf, sh in zip(jax.tree.leaves(state), jax.tree.leaves(
      engine.state_shardings)):
    assert leaf.sharding.is_equivalent_to(sh, leaf.ndim)
    assert leaf.sharding.memory_kind == sh.memory_kind
  state, losses = m.run_steps(engine, state, BATCHES[5:])
  _assert_uninterrupted(losses, engine.gather_params(state), saved)


def test_restore_only_needs_shapes(saved):
  engine = _engine(1, devices=8)
  shapes = jax.eval_shape(m.mlp_params)
  with zj.Checkpointer(saved[0]["plain"]) as ckpt:
    state = ckpt.restore(engine, shapes)
  state, losses = m.run_steps(engine, state, BATCHES[5:])
  _assert_uninterrupted(losses, engine.gather_params(state), saved)


def test_a_closed_checkpointer_says_it_is_closed(saved, tmp_path):
  # (Not orbax's "cannot schedule new futures after shutdown", wrapped as
  # a disk error that asks to free space.)
  engine = _engine(3)
  state = engine.init(m.mlp_params())
  with zj.Checkpointer(tmp_path / "c") as ckpt:
    pass
  with pytest.raises(RuntimeError, match="is closed.*cannot save.*new "
                     "Checkpointer"):
    ckpt.save(state)
  reader = zj.Checkpointer(saved[0]["plain"], read_only=True)
  reader.close()
  with pytest.raises(RuntimeError, match="is closed.*cannot restore"):
    reader.restore(engine, m.mlp_params())
  assert not os.listdir(tmp_path / "c")  # (nothing was written)


def test_mixed_precision_copy_and_loss_scale_are_rebuilt(tmp_path):
  # float16 at stage 3 with offload (a sharded compute copy) restored at
  # stage 2 (a replicated compute copy): the copy is a cast of the master,
  # and the loss scale comes back.
  fp16 = {"compute_dtype": "float16", "loss_scale_window": 2}
  engine = _engine(3, offload_optimizer="host", **fp16)
  state, _ = m.run_steps(engine, engine.init(m.mlp_params()), BATCHES[:3])
  scale = jax.tree.map(np.asarray, state.loss_scale)
  with zj.Checkpointer(tmp_path) as ckpt:
    ckpt.save(state)
    ckpt.wait()
    other = _engine(2, devices=4, **fp16)
    restored = ckpt.restore(other, m.mlp_params())
    assert jax.tree.map(np.asarray, restored.loss_scale) == scale
    assert float(restored.loss_scale.scale) == 2.0 ** 17  # doubled once
    for c, p in zip(jax.tree.leaves(restored.compute_params),
                    jax.tree.leaves(other.gather_params(restored))):
      assert c.dtype == jnp.float16
      np.testing.assert_array_equal(np.asarray(c),
                                    np.asarray(p).astype(np.float16))
    # Without float16 only the skip count carries over (the scale is 1);
    # with it but from a checkpoint without one, it starts afresh.
    bf16 = ckpt.restore(_engine(1, compute_dtype="bfloat16"),
                        m.mlp_params()).loss_scale
    assert float(bf16.scale) == 1.0 and int(bf16.skipped) == int(scale.skipped)
    assert ckpt.restore(_engine(1, skip_nonfinite=False),
                        m.mlp_params()).loss_scale is None
  with zj.Checkpointer(tmp_path / "fp32") as ckpt:
    ckpt.save(_engine(0).init(m.mlp_params()))
    ckpt.wait()
    fresh = ckpt.restore(_engine(0, **fp16), m.mlp_params()).loss_scale
    assert float(fresh.scale) == 2.0 ** 16 and int(fresh.skipped) == 0


def test_keeps_the_last_k_and_resumes_the_latest(tmp_path):
  engine = _engine(2)
  state = engine.init(m.mlp_params())
  with zj.Checkpointer(tmp_path, max_to_keep=2) as ckpt:
    assert ckpt.latest_step() is None
    with pytest.raises(FileNotFoundError, match="engine.init"):
      ckpt.restore(engine, m.mlp_params())
    for b in BATCHES[:4]:
      state, _ = engine.step(state, b)
      assert ckpt.save(state)
    assert not ckpt.save(state)  # this step is saved already
    want = jax.tree.map(np.asarray, engine.gather_params(state))
  # A new Checkpointer (a restarted job) sees what was committed.
  with zj.Checkpointer(tmp_path, max_to_keep=2) as ckpt:
    assert ckpt.all_steps() == [3, 4] and ckpt.latest_step() == 4
    state = ckpt.restore(engine, m.mlp_params())
    assert int(state.step) == 4
    got = engine.gather_params(state)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    with pytest.raises(FileNotFoundError, match=r"kept: \[3, 4\]"):
      ckpt.restore(engine, m.mlp_params(), step=1)


def test_async_save_is_not_disturbed_by_the_next_donating_steps(tmp_path):
  engine = _engine(3)
  state, _ = m.run_steps(engine, engine.init(m.mlp_params()), BATCHES[:2])
  want = jax.tree.map(np.asarray, (state.params, state.opt_state))
  with zj.Checkpointer(tmp_path) as ckpt:
    ckpt.save(state)
    # The next steps donate the state being saved.
    state, _ = m.run_steps(engine, state, BATCHES[2:6])
    ckpt.wait()
    restored = ckpt.restore(engine, m.mlp_params(), step=2)
  got = jax.tree.map(np.asarray, (restored.params, restored.opt_state))
  jax.tree.map(np.testing.assert_array_equal, got, want)


# ----------------------------------------------------------- bad input


def _wider_params():
  p = m.mlp_params()
  return dict(p, w2=jnp.zeros((64, 32)), w3=jnp.zeros((32, 8)))


@pytest.mark.parametrize("make_engine,params,match", [
    (lambda: _engine(3), _wider_params,
     r"params/w2 has shape \(64, 64\) in the checkpoint but \(64, 32\) here"),
    (lambda: _engine(3), lambda: dict(m.mlp_params(), b2=jnp.zeros(64)),
     r"params/b2 is missing from the checkpoint"),
    (lambda: _engine(3), lambda: {k: v for k, v in m.mlp_params().items()
                                  if k != "b1"},
     r"params/b1 is in the checkpoint but not in this model"),
    (lambda: _engine(3, tx=optax.sgd(0.1, momentum=0.9)), m.mlp_params,
     r"opt_state/0/trace/b1 is missing"),
])
def test_a_mismatched_checkpoint_names_the_first_differing_leaf(
    saved, make_engine, params, match):
  with zj.Checkpointer(saved[0]["plain"]) as ckpt:
    with pytest.raises(ValueError, match=match) as e:
      ckpt.restore(make_engine(), params())
  assert "saved at stage 3 on 8 device(s)" in str(e.value)


@pytest.mark.parametrize("what", ["data", "metadata"])
def test_a_corrupt_checkpoint_is_a_clear_error(saved, tmp_path, what):
  broken = tmp_path / "broken"
  shutil.copytree(saved[0]["plain"], broken)
  files = [f for f in (broken / "5" / "state").rglob("*") if f.is_file() and
           (f.parent.name == "d") == (what == "data")]
  assert files
  for f in files:
    f.write_bytes(b"garbage")
  with zj.Checkpointer(broken) as ckpt:
    with pytest.raises(ValueError, match=r"step 5 .* corrupt .* earlier"):
      ckpt.restore(_engine(3), m.mlp_params())


# ---------------------------------------------------------- processes


def test_killed_during_an_async_save_the_previous_checkpoint_restores(
    tmp_path):
  proc = _worker(8, "kill_during_save", tmp_path)
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if line.startswith("SAVING"):
      break
  assert lines and lines[-1].startswith("SAVING"), "".join(lines)[-3000:]
  # The save of step 2 is under way: written to a temporary directory.
  deadline = time.time() + 60
  while not any("tmp" in p.name for p in tmp_path.iterdir()):
    assert time.time() < deadline, list(tmp_path.iterdir())
    time.sleep(0.1)
  proc.kill()
  proc.wait(timeout=60)
  engine = _engine(3)
  _, want = m.run_steps(engine, engine.init(m.mlp_params()), BATCHES[:3])
  with zj.Checkpointer(tmp_path) as ckpt:
    assert ckpt.all_steps() == [1]
    state = ckpt.restore(engine, m.mlp_params())
    assert int(state.step) == 1
    # Training goes on from there, and saves again over the debris.
    state, losses = m.run_steps(engine, state, BATCHES[1:3])
    np.testing.assert_allclose(losses, want[1:], rtol=1e-6)
    assert ckpt.save(state)
  with zj.Checkpointer(tmp_path) as ckpt:
    assert ckpt.all_steps() == [1, 3]


def test_sigterm_saves_a_final_checkpoint(tmp_path):
  proc = _worker(8, "sigterm", tmp_path)
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if line.startswith("step 6"):
      proc.send_signal(signal.SIGTERM)
  proc.wait(timeout=60)
  log = "".join(lines)
  assert proc.returncode == 143, log[-3000:]
  stopped = int(lines[-1].split()[-1])
  assert lines[-1].startswith("PREEMPTED AT") and stopped >= 6, log[-3000:]
  with zj.Checkpointer(tmp_path) as ckpt:
    assert ckpt.latest_step() == stopped
    assert int(ckpt.restore(_engine(2), m.mlp_params()).step) == stopped


# -------------------------------------------------------------- export


@pytest.mark.parametrize("stage,overrides", [(3, {}), (1, {}),
                                             (3, OFFLOAD)])
def test_export_loads_with_plain_orbax(tmp_path, stage, overrides):
  engine = _engine(stage, **overrides)
  state, _ = m.run_steps(engine, engine.init(m.mlp_params()), BATCHES[:3])
  full = jax.tree.map(np.asarray, engine.gather_params(state))
  zj.export_params(engine, state, tmp_path / "fp32")
  zj.export_params(engine, state, tmp_path / "bf16", dtype=jnp.bfloat16)
  with pytest.raises(FileExistsError):
    zj.export_params(engine, state, tmp_path / "fp32")
  # Plain orbax, no zero_jax, no target: whole arrays.
  got = ocp.StandardCheckpointer().restore(tmp_path / "fp32")
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, got),
               full)
  half = ocp.StandardCheckpointer().restore(tmp_path / "bf16")
  for k, v in half.items():
    assert v.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(v),
                                  full[k].astype(jnp.bfloat16))


def test_load_params_starts_training_with_a_fresh_optimizer(tmp_path):
  engine = _engine(2)
  state, _ = m.run_steps(engine, engine.init(m.mlp_params()), BATCHES[:3])
  zj.export_params(engine, state, tmp_path / "p")
  trained = jax.tree.map(np.asarray, engine.gather_params(state))
  other = _engine(3, devices=4)
  params = zj.load_params(tmp_path / "p", other, m.mlp_params())
  # Read straight into the new engine's layout.
  for x, sh in zip(jax.tree.leaves(params),
                   jax.tree.leaves(other.param_plan.shardings)):
    assert x.sharding.is_equivalent_to(sh, x.ndim)
  fresh = other.init(params)
  assert int(fresh.step) == 0
  _, want = m.train_reference(m.mlp_loss, TX, trained, BATCHES[3:6])
  state, _ = m.run_steps(other, fresh, BATCHES[3:6])
  m.assert_matches([0.0], other.gather_params(state), [0.0], want)
  with pytest.raises(ValueError, match=r"params/w2 has shape"):
    zj.load_params(tmp_path / "p", other, _wider_params())


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_exported_params_load_into_a_plain_flax_model(framework, tmp_path):
  # Trained under zero_jax (scan_linen / scan_nnx at stage 3), loaded with
  # plain orbax into the same model written with nn.scan / nnx.scan.
  from flax import nnx  # pylint: disable=g-import-not-at-top
  # pylint: disable-next=g-import-not-at-top
  from tests.layers import test_flax_layers as fl
  loss_fn, params = fl.SETUPS[framework]()
  engine = _engine(3, loss=loss_fn)
  data = fl.batches(4)
  state, _ = m.run_steps(engine, engine.init(params), data[:3])
  zj.export_params(engine, state, tmp_path / "params")
  _, metrics = engine.step(state, data[3])  # the loss before this update
  ckptr = ocp.StandardCheckpointer()
  if framework == "linen":
    model = fl.LinenModel(adapter=False)
    loaded = ckptr.restore(tmp_path / "params")
    out = model.apply({"params": loaded}, data[3]["x"])
  else:
    abstract = nnx.eval_shape(lambda: fl.NNXModel(False, rngs=nnx.Rngs(0)))
    graphdef, target = nnx.split(abstract)
    model = nnx.merge(graphdef, ckptr.restore(tmp_path / "params", target))
    out = model(data[3]["x"])
  loss = float(jnp.mean((out - data[3]["y"]) ** 2))  # (the models' loss)
  np.testing.assert_allclose(loss, float(metrics["loss"]), rtol=1e-6)


def test_sigterm_still_terminates_a_loop_that_never_asks(tmp_path):
  # A Checkpointer alone must not make a process immune to SIGTERM.
  script = ("import os, signal, time, zero_jax as zj\n"
            f"c = zj.Checkpointer({str(tmp_path)!r})\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(30)\n")
  proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT,
                        env=dict(os.environ, PYTHONPATH=ROOT),
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == -signal.SIGTERM, proc.stderr[-2000:]


def _doc_block(page: str, says: str) -> str:
  """The python block of docs/<page> that contains ``says``."""
  text = open(os.path.join(ROOT, "docs", page), encoding="utf-8").read()
  blocks = [b for b in re.findall(r"^```python\n(.*?)^```", text,
                                  re.M | re.S) if says in b]
  assert len(blocks) == 1, f"docs/{page}: {len(blocks)} blocks with {says!r}"
  return blocks[0]


def test_an_export_of_8_devices_loads_on_1_with_the_documented_code(
    tmp_path):
  # docs/checkpoints.md's plain-orbax load, as written, in a process with
  # one CPU device and without zero_jax: orbax would rebuild the exporting
  # engine's 8-device sharding ("Topology mismatch detected") and refuses
  # a relative path.
  engine = _engine(3)
  state, _ = m.run_steps(engine, engine.init(m.mlp_params()), BATCHES[:2])
  zj.export_params(engine, state, tmp_path / "out", dtype=jnp.bfloat16)
  want = {k: np.asarray(v.astype(jnp.bfloat16)).astype(np.float32)
          for k, v in engine.gather_params(state).items()}
  code = _doc_block("checkpoints.md", "on_device = ocp.StandardCheckpointer")
  code += textwrap.dedent("""
      import sys
      assert len(jax.devices()) == 1, jax.devices()
      assert not any(m.startswith("zero_jax") for m in sys.modules)
      assert all(isinstance(v, np.ndarray) for v in params.values())
      assert all(v.devices() == {jax.devices()[0]}
                 for v in on_device.values())
      np.savez("got.npz", **{k: np.asarray(v, np.float32)
                             for k, v in params.items()},
               **{"on_device/" + k: np.asarray(v, np.float32)
                  for k, v in on_device.items()})
      """)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  env.pop("PYTHONPATH", None)  # (no zero_jax: plain orbax)
  out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  got = np.load(tmp_path / "got.npz")
  for k, v in want.items():
    np.testing.assert_array_equal(got[k], v)
    np.testing.assert_array_equal(got["on_device/" + k], v)


def test_an_export_names_no_devices_and_keeps_orbaxs_standard_format(
    tmp_path):
  # Restored without a target on the same devices too, the export gives
  # whole host arrays (no device layout recorded), and zero_jax's own
  # load_params takes a relative path.
  engine = _engine(3)
  state = engine.init(m.mlp_params())
  zj.export_params(engine, state, tmp_path / "p")
  got = ocp.StandardCheckpointer().restore(tmp_path / "p")
  assert all(isinstance(v, np.ndarray) for v in got.values()), got
  cwd = os.getcwd()
  os.chdir(tmp_path)
  try:
    params = zj.load_params("p", engine, m.mlp_params())
  finally:
    os.chdir(cwd)
  for x, sh in zip(jax.tree.leaves(params),
                   jax.tree.leaves(engine.param_plan.shardings)):
    assert x.sharding.is_equivalent_to(sh, x.ndim)


def test_the_mismatch_message_docs_checkpoints_md_quotes_is_the_real_one(
    saved, tmp_path, monkeypatch):
  text = open(os.path.join(ROOT, "docs", "checkpoints.md"),
              encoding="utf-8").read()
  quote = re.search(r"e\.g\. `(checkpoint of step [^`]*)`", text, re.S)
  assert quote, "docs/checkpoints.md quotes no mismatch message"
  quote = " ".join(quote.group(1).split())
  shutil.copytree(saved[0]["plain"], tmp_path / "ckpt")
  monkeypatch.chdir(tmp_path)
  with zj.Checkpointer("ckpt") as ckpt:
    with pytest.raises(ValueError) as e:
      ckpt.restore(_engine(3), _wider_params())
  assert quote in str(e.value), (quote, str(e.value))
