"""The NVMe tier (offload_optimizer="nvme"): training bit for bit the host
tier's, its files and what it reports, resuming a committed step, short
files and checkpoints to and from every other placement."""

import dataclasses
import json
import os

import jax
import numpy as np
import optax
import pytest

import zero_jax as zj
from tests import _models as m
from zero_jax import offload
from zero_jax.offload import DiskError

STEPS = 4
CLIP = 0.5
# Small slices: 2048 parameters (the MLP's 4096-element leaf spans two, two
# small ones share one).
SMALL = dict(slice_bytes=2048 * 12, buffer_count=3)


def _optimizer(name):
  decay_matrices = lambda p: jax.tree.map(lambda x: len(x.shape) > 1, p)
  return {
      "adamw": lambda: offload.adamw(1e-2, weight_decay=0.1,
                                     mask=decay_matrices),
      "adam": lambda: offload.adam(optax.linear_schedule(1e-2, 1e-3, 3)),
      "lion": lambda: offload.lion(1e-3, weight_decay=0.1),
      "sgd": lambda: offload.sgd(1e-2, momentum=0.9, nesterov=True),
      "adagrad": lambda: offload.adagrad(1e-2),
  }[name]()


def _config(where, stage, dtype, accum=None, path=None, delay=False,
            **options):
  kw = dict(stage=stage, offload_optimizer=where, update_on="host",
            clip_grad_norm=CLIP, compute_dtype=dtype, grad_accum_steps=accum,
            min_shard_elements=0, delay_update=delay)
  if where == "nvme":
    kw.update(nvme_path=str(path), nvme=zj.NvmeOptions(**{**SMALL,
                                                          **options}))
  return zj.ZeroConfig(**kw)


def _engine(tx, config, devices=8):
  return zj.Engine(m.mlp_loss, tx, config, zj.make_mesh(num_devices=devices))


def _equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# (optimizer, stage, compute dtype, micro-batches): every optimizer, every
# stage, each 16-bit dtype and fp32, with and without accumulation; all
# with clipping.
CASES = [("adamw", 3, "bfloat16", None), ("adam", 1, "float16", 2),
         ("lion", 2, "bfloat16", 2), ("sgd", 3, "float16", None),
         ("adagrad", 2, "float32", None)]


@pytest.mark.parametrize("name,stage,dtype,accum", CASES)
def test_nvme_trains_bit_for_bit_as_host_offload(tmp_path, name, stage,
                                                 dtype, accum):
  params, batches = m.mlp_params(), m.mlp_batches(STEPS)
  host = _engine(_optimizer(name), _config("host", stage, dtype, accum))
  nvme = _engine(_optimizer(name), _config("nvme", stage, dtype, accum,
                                           tmp_path))
  ref_losses, ref, _ = m.train_engine(host, params, batches)
  losses, out, state = m.train_engine(nvme, params, batches)
  assert losses == ref_losses
  _equal(out, ref)
  tier = nvme.layout.update.host
  assert len(tier.plan.slices) >= 3
  # The state is read-only views of the committed files.
  assert all(isinstance(x, np.memmap) and not x.flags.writeable
             for x in jax.tree.leaves(state.params))
  root = tmp_path / "process-0"
  kinds = len(tier.plan.dtypes)
  assert sorted(os.listdir(root)) == sorted(
      ["manifest.json"] + [f"{k}.{v}" for k in ["master"] + [
          f"state{t}" for t in range(1, kinds)] for v in (0, 1)])
  manifest = json.loads((root / "manifest.json").read_text())
  assert manifest["step"] == STEPS and manifest["optimizer"] == (
      tier.rule.kind.value)
  text = nvme.describe()
  per = 4 * kinds
  assert "NVMe tier" in text and "O_DIRECT" in text
  assert f"per step {per} bytes a parameter read and {per} written" in text
  assert (f"{tier.budget_bytes() / 2**20:,.1f} MiB of host RAM for 3 "
          "slices") in text
  assert tier.budget_bytes() <= SMALL["buffer_count"] * SMALL["slice_bytes"]
  assert tier.io["read"] == tier.io["written"] == sum(
      tier.plan.file_bytes(t) for t in range(kinds))


def test_nvme_delay_update_is_the_host_tiers(tmp_path):
  params, batches = m.mlp_params(), m.mlp_batches(STEPS)
  runs = []
  for where in ("host", "nvme"):
    engine = _engine(_optimizer("adamw"),
                     _config(where, 2, "bfloat16", path=tmp_path, delay=True))
    runs.append(m.train_engine(engine, params, batches)[:2])
  assert engine.layout.update.host.background_updates == STEPS
  assert runs[0][0] == runs[1][0]
  _equal(runs[0][1], runs[1][1])


def test_resume_is_asked_for_and_continues_bit_for_bit(tmp_path):
  params, batches = m.mlp_params(), m.mlp_batches(STEPS)
  make = lambda resume, p=params: _engine(
      _optimizer("adamw"), _config("nvme", 3, "float16", path=tmp_path,
                                   resume=resume))
  first = make(None)
  state, losses = m.run_steps(first, first.init(params), batches[:2])
  first.layout.update.host.close()
  with pytest.raises(FileExistsError, match=r"step 2.*resume=True"):
    make(None).init(params)
  engine = make(True)
  again = engine.init(params)
  assert int(again.step) == 2
  assert float(again.loss_scale.scale) == float(state.loss_scale.scale)
  _equal(engine.gather_params(again), first.gather_params(state))
  _equal(again.opt_state, state.opt_state)
  again, more = m.run_steps(engine, again, batches[2:])
  ref_losses, ref, _ = m.train_engine(
      _engine(_optimizer("adamw"), _config("host", 3, "float16")), params,
      batches)
  assert losses + more == ref_losses
  _equal(engine.gather_params(again), ref)
  # resume=False starts afresh; another model's state is refused.
  assert int(make(False).init(params).step) == 0
  other = jax.tree.map(lambda x: x[..., :1], params)
  with pytest.raises(ValueError, match="another model"):
    make(True).init(other)
  # Afresh over another model's files: they are made to this one's size,
  # and its state is what a resume finds.
  engine = make(False)
  engine.init(other)
  again = make(True)
  _equal(again.gather_params(again.init(other)), other)


def test_short_read_and_flipped_bits_name_the_file(tmp_path):
  params, batches = m.mlp_params(), m.mlp_batches(STEPS)
  engine = _engine(_optimizer("adamw"), _config("nvme", 3, "bfloat16",
                                                path=tmp_path))
  state, _ = m.run_steps(engine, engine.init(params), batches[:1])
  tier = engine.layout.update.host
  committed = json.loads(
      (tmp_path / "process-0" / "manifest.json").read_text())["version"]
  path = tmp_path / "process-0" / f"master.{committed}"
  size = os.path.getsize(path)
  # A bit flipped: the read that meets it says which file and step.
  flip = lambda: _flip(path, 5000)
  flip()
  with pytest.raises(DiskError, match=rf"master\.{committed}.*step 1"):
    engine.step(state, batches[1])
  flip()  # (mended: the state is as committed)
  # Cut short: the read past the end names the file.
  os.truncate(path, size // 2)
  with pytest.raises(DiskError, match=rf"short read of .*master\.{committed}"):
    engine.step(state, batches[1])
  assert tier.plan.file_bytes(0) == size


def _flip(path, offset):
  with open(path, "r+b") as f:
    f.seek(offset)
    byte = f.read(1)
    f.seek(offset)
    f.write(bytes([byte[0] ^ 1]))


def test_checkpoints_round_trip_between_nvme_and_every_placement(tmp_path):
  params, batches = m.mlp_params(), m.mlp_batches(STEPS)
  nvme = _engine(_optimizer("adamw"), _config("nvme", 3, "bfloat16",
                                              path=tmp_path / "nvme"))
  state, _ = m.run_steps(nvme, nvme.init(params), batches[:2])
  saved = nvme.gather_params(state)
  with zj.Checkpointer(tmp_path / "a") as ckpt:
    ckpt.save(state, engine=nvme)
  others = {
      "host": _engine(_optimizer("adamw"), _config("host", 3, "bfloat16")),
      "device, 4 devices, stage 1": _engine(
          _optimizer("adamw"), zj.ZeroConfig(
              stage=1, compute_dtype="bfloat16", clip_grad_norm=CLIP,
              min_shard_elements=0), devices=4),
      "streamed": _engine(_optimizer("adamw"), zj.ZeroConfig(
          stage=3, compute_dtype="bfloat16", offload_optimizer="host",
          clip_grad_norm=CLIP, min_shard_elements=0)),
  }
  back = _engine(_optimizer("adamw"), _config(
      "nvme", 1, "bfloat16", path=tmp_path / "back", resume=False))
  for name, other in others.items():
    with zj.Checkpointer(tmp_path / "a", read_only=True) as ckpt:
      there = ckpt.restore(other, params)
    _equal(other.gather_params(there), saved)
    _equal(there.opt_state, state.opt_state)
    folder = tmp_path / name.replace(" ", "_").replace(",", "")
    with zj.Checkpointer(folder) as ckpt:
      ckpt.save(there, engine=other)
    with zj.Checkpointer(folder, read_only=True) as ckpt:
      home = ckpt.restore(back, params)
    _equal(back.gather_params(home), saved)
    _equal(home.opt_state, state.opt_state)
  # Continued from the checkpoint, the host tier (the same stage) trains
  # as NVMe does.
  with zj.Checkpointer(tmp_path / "a", read_only=True) as ckpt:
    host = others["host"]
    there = ckpt.restore(host, params)
  there, losses = m.run_steps(host, there, batches[2:])
  state, nvme_losses = m.run_steps(nvme, state, batches[2:])
  assert losses == nvme_losses
  _equal(host.gather_params(there), nvme.gather_params(state))


def test_bad_nvme_setups_name_the_fix(tmp_path):
  with pytest.raises(ValueError, match="zero_jax.offload's adamw"):
    _engine(optax.adamw(1e-2), _config("nvme", 3, "bfloat16",
                                       path=tmp_path)).init(m.mlp_params())
  params, batches = m.mlp_params(), m.mlp_batches(2)
  engine = _engine(_optimizer("adamw"), _config("nvme", 3, "bfloat16",
                                                path=tmp_path))
  old = engine.init(params)
  m.run_steps(engine, old, batches[:1])
  with pytest.raises(ValueError, match="updated in place"):
    engine.step(old, batches[1])


def test_the_users_deepspeed_json_with_nvme_trains_as_host_offload(
    tmp_path):
  # experiments/ds_config.json with "device": "nvme" (its nvme_path here a
  # temporary directory), an AdamW section and clipping; micro-batches of
  # 1 so that 32 = 1 x 4 x 8 devices.
  root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
  with open(os.path.join(root, "experiments", "ds_config.json")) as f:
    ds = json.load(f)
  ds["zero_optimization"]["offload_optimizer"].update(
      device="nvme", nvme_path=str(tmp_path), buffer_count=3)
  ds.update(train_micro_batch_size_per_gpu=1, gradient_clipping=CLIP,
            optimizer={"type": "AdamW",
                       "params": {"lr": 1e-2, "weight_decay": 0.1}})
  params, batches = m.mlp_params(), m.mlp_batches(STEPS)
  mesh = zj.make_mesh(num_devices=8)
  with pytest.warns(UserWarning, match="host"):
    engine, state = zj.initialize(m.mlp_loss, params, ds, mesh)
  config = engine.config
  assert (config.offload_optimizer, config.nvme_path, config.update_on,
          config.nvme.buffer_count, config.nvme.resume) == (
              "nvme", str(tmp_path), "host", 3, False)
  state, losses = m.run_steps(engine, state, batches)
  assert os.path.exists(tmp_path / "process-0" / "manifest.json")
  host = zj.Engine(m.mlp_loss, engine.tx, dataclasses.replace(
      config, offload_optimizer="host", nvme_path=None), mesh)
  ref_losses, ref, _ = m.train_engine(host, params, batches)
  assert losses == ref_losses
  _equal(engine.gather_params(state), ref)


def test_a_save_goes_on_in_the_background_until_its_files_are_rewritten(
    tmp_path, monkeypatch):
  # The saved views' files are written two updates later: the save is not
  # finished before save() returns, nor before the next step, only before
  # the step after it.
  params, batches = m.mlp_params(), m.mlp_batches(STEPS)
  engine = _engine(_optimizer("adamw"), _config("nvme", 3, "bfloat16",
                                                path=tmp_path / "nvme"))
  state, _ = m.run_steps(engine, engine.init(params), batches[:1])
  saved = jax.tree.map(np.array, engine.gather_params(state))
  waits = []
  settle = zj.Checkpointer._settle
  monkeypatch.setattr(zj.Checkpointer, "_settle",
                      lambda self: (waits.append(1), settle(self)))
  ckpt = zj.Checkpointer(tmp_path / "ckpt")
  ckpt.save(state, engine=engine)
  assert waits == []
  state, _ = m.run_steps(engine, state, batches[1:2])
  assert waits == []
  state, _ = m.run_steps(engine, state, batches[2:3])
  assert waits == [1]
  ckpt.close()
  with zj.Checkpointer(tmp_path / "ckpt", read_only=True) as c:
    again = c.restore(engine, params)
  assert int(again.step) == 1
  _equal(engine.gather_params(again), saved)


@pytest.mark.parametrize("delay", [False, True])
def test_one_cpu_device_takes_the_host_copy_as_its_own(tmp_path, delay):
  # On one CPU device the compute copy is the host buffer the update
  # writes (no second copy in RAM); the next update writes it only once the
  # step that read it is done, so training is the 8-device host tier's.
  # (With delay_update the device reads one copy while the host writes the
  # next: a copy of its own.)
  params, batches = m.mlp_params(), m.mlp_batches(STEPS)
  runs = []
  for where, devices in (("nvme", 1), ("host", 1), ("host", 8)):
    engine = _engine(_optimizer("adamw"), _config(
        where, 3, "bfloat16", path=tmp_path, delay=delay), devices=devices)
    losses, out, state = m.train_engine(engine, params, batches)
    runs.append((losses, out))
    if devices == 1:
      copy = jax.tree.leaves(state.compute_params)[0]
      bufs = [np.asarray(b).ctypes.data for t in engine.layout.update.host
              ._copies if t for b in jax.tree.leaves(t)]
      assert (copy.unsafe_buffer_pointer() in bufs) is not delay
  for losses, out in runs[1:]:
    np.testing.assert_allclose(losses, runs[0][0], rtol=2e-6)
  assert runs[0][0] == runs[1][0]
  _equal(runs[0][1], runs[1][1])
