"""Checkpoints never drop a save or restore corrupted bytes: a rollback's
new history replaces the abandoned one, another run's directory is
refused, every array's bytes are checked at restore, and a read-only mount
restores."""

import functools
import os
import shutil
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest

import zero_jax as zj
from tests import _models as m

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
TX = optax.adamw(1e-2)
BATCHES = m.mlp_batches(3)
OTHER = m.mlp_batches(3, seed=7)  # (the settings a rollback changes)
TIME_LIMIT_S = 240


@functools.cache
def _engine(stage=3, **overrides):
  """One engine per configuration, shared by the tests (an engine holds no
  training state: its steps are traced and compiled once in the file)."""
  config = zj.ZeroConfig(stage=stage, min_shard_elements=0, **overrides)
  return zj.Engine(m.mlp_loss, TX, config, zj.make_mesh(8))


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _equal(a, b) -> bool:
  return all(np.array_equal(x, y) for x, y in zip(_leaves(a), _leaves(b)))


def _run_python(code: str, *prefix: str) -> subprocess.CompletedProcess:
  """``code`` in a fresh process of 8 CPU devices (optionally run through
  ``prefix``, e.g. a mount namespace), with a time limit."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  return subprocess.run([*prefix, sys.executable, "-c", code], cwd=ROOT,
                        env=env, capture_output=True, text=True,
                        timeout=TIME_LIMIT_S)


_WORKER = """
import optax, zero_jax as zj
from tests import _models as m
engine = zj.Engine(m.mlp_loss, optax.adamw(1e-2),
                   zj.ZeroConfig(stage=3, min_shard_elements=0),
                   zj.make_mesh(8))
params = m.mlp_params()
"""


@pytest.fixture
def three_steps(tmp_path):
  """Steps 1-3 saved, and the state of each."""
  engine = _engine()
  state = engine.init(m.mlp_params())
  states = {}
  directory = str(tmp_path / "ckpt")
  with zj.Checkpointer(directory, max_to_keep=None) as ckpt:
    for b in BATCHES:
      state, _ = engine.step(state, b)
      assert ckpt.save(state) is True
      states[int(state.step)] = engine.gather_params(state)
  return engine, directory, states


# ------------------------------------------------- 1: a rollback's history


def test_a_rollback_saves_its_steps_and_a_restart_resumes_them(three_steps):
  engine, directory, old = three_steps
  ckpt = zj.Checkpointer(directory, max_to_keep=None)
  state = ckpt.restore(engine, m.mlp_params(), step=1)
  for b in OTHER[:2]:  # (other data after the rollback)
    state, _ = engine.step(state, b)
    assert ckpt.save(state) is True  # (was a silent False)
  ckpt.close()
  new = engine.gather_params(state)
  # The abandoned steps are kept where no restore looks.
  aside = os.listdir(os.path.join(directory, "abandoned"))
  assert len(aside) == 1 and aside[0].startswith("after-step-1-")
  assert sorted(os.listdir(os.path.join(directory, "abandoned",
                                        aside[0]))) == ["2", "3"]
  # A restart resumes the new run's step 3, which is single-device optax
  # on the new history's batches.
  restarted = zj.Checkpointer(directory)
  assert restarted.all_steps() == [1, 2, 3]
  resumed = restarted.restore(engine, m.mlp_params())
  assert int(resumed.step) == 3
  assert _equal(engine.gather_params(resumed), new)
  assert not _equal(new, old[3])
  _, ref = m.train_reference(m.mlp_loss, TX, m.mlp_params(),
                             BATCHES[:1] + OTHER[:2])
  assert m.rel_err(engine.gather_params(resumed), ref) < 1e-5
  restarted.close()
  # And the abandoned run restores from its folder.
  folder = os.path.join(directory, "abandoned", aside[0])
  with zj.Checkpointer(folder, read_only=True) as old_run:
    assert _equal(engine.gather_params(
        old_run.restore(engine, m.mlp_params(), step=3)), old[3])


def test_a_second_state_of_a_saved_step_is_refused_not_dropped(three_steps):
  engine, directory, _ = three_steps
  with zj.Checkpointer(directory, max_to_keep=None) as ckpt:
    # The same values again: nothing to write.
    same = ckpt.restore(engine, m.mlp_params(), step=3)
    assert ckpt.save(same) is False
    # Other values for step 3 without a rollback: refused, never dropped.
    other = engine.init(m.mlp_params())
    for b in OTHER:
      other, _ = engine.step(other, b)
    with pytest.raises(zj.CheckpointConflictError,
                       match=r"refusing to save step 3 .*step 3: saved by "
                       r"run .* with other values") as e:
      ckpt.save(other)
    assert e.value.step == 3
    assert ckpt.all_steps() == [1, 2, 3]


def test_another_runs_directory_is_refused(three_steps):
  """A second job writing into the directory (or a fresh start that forgot
  to restore) is refused, and the first run's steps are untouched."""
  _, directory, _ = three_steps
  code = _WORKER + textwrap.dedent(f"""
      state = engine.init(params)
      for b in m.mlp_batches(2, seed=3):
        state, _ = engine.step(state, b)
      ckpt = zj.Checkpointer({directory!r})
      try:
        ckpt.save(state)
      except zj.CheckpointConflictError as e:
        print("REFUSED", e.step, e)
        raise SystemExit(3)
      """)
  proc = _run_python(code)
  assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
  out = proc.stdout
  assert "REFUSED 2" in out
  for needed in ("step 1: written by run", "did not restore from",
                 "give each job its own directory", "restore it first"):
    assert needed in out, out
  assert sorted(os.listdir(directory)) == ["1", "2", "3"]


# ------------------------------------------------------- 2: corrupt bytes


def _data_files(step_dir: str) -> list[str]:
  """The array files of a step: orbax's OCDBT data under state/, largest
  first (values of more than a kilobyte live there, the rest in the root
  node's file)."""
  files = []
  for base, _, names in os.walk(os.path.join(step_dir, "state")):
    files += [os.path.join(base, n) for n in names
              if os.sep + "d" + os.sep in os.path.join(base, n) + os.sep
              or base.endswith(os.sep + "d")]
  return sorted(files, key=os.path.getsize, reverse=True)


def test_a_bit_flip_anywhere_in_an_array_file_is_caught(three_steps):
  """A flip anywhere in the file is caught or changes nothing that is
  restored (orbax leaves bytes no restore reads); most flips in the file's
  first half, where the values are, are caught. (Not every one: how
  orbax's OCDBT batches its asynchronous writes into data files varies
  from run to run, and a file may hold bytes that no restore reads.)"""
  engine, directory, states = three_steps
  step_dir = os.path.join(directory, "3")
  data = _data_files(step_dir)[0]
  original = open(data, "rb").read()
  rng = np.random.default_rng(0)
  values = sorted({0, 1, *rng.integers(0, len(original) // 2, 6).tolist()})
  anywhere = sorted(rng.integers(0, len(original), 4).tolist() +
                    [len(original) - 1])
  caught = 0
  for offset in values + anywhere:
    bad = bytearray(original)
    bad[offset] ^= 1 << int(rng.integers(0, 8))
    with open(data, "wb") as f:
      f.write(bytes(bad))
    with zj.Checkpointer(directory, read_only=True) as ckpt:
      try:
        restored = ckpt.restore(engine, m.mlp_params())
      except zj.CheckpointCorruptError as e:
        err = e
      else:
        # Never silently wrong: what was not caught restores intact.
        assert _equal(engine.gather_params(restored), states[3]), offset
        continue
    caught += 1
    assert err.step == 3 and err.intact_step == 2, (offset, err)
    assert "checkpoint of step 3" in str(err), (offset, err)
    assert err.leaves and all(leaf.startswith("state.")
                              for leaf in err.leaves), (offset, err)
    assert data in err.files, (offset, err.files)
    assert "restore(engine, params, step=2)" in str(err), (offset, err)
  assert caught > len(values) // 2, (caught, values)
  with open(data, "wb") as f:
    f.write(original)
  # The rest of the checkpoint was intact all along.
  with zj.Checkpointer(directory, read_only=True) as ckpt:
    restored = ckpt.restore(engine, m.mlp_params())
    assert _equal(engine.gather_params(restored), states[3])


def test_a_checkpoint_that_orbax_cannot_decode_names_the_intact_step(
    three_steps):
  engine, directory, states = three_steps
  # Every file under step 3's state item, damaged in its middle: whichever
  # way it fails (orbax's error or a checksum), it is this error.
  root_node = _data_files(os.path.join(directory, "3"))
  for path in root_node:
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0xFF
    with open(path, "wb") as f:
      f.write(bytes(raw))
  ckpt = zj.Checkpointer(directory, read_only=True)
  with pytest.raises(zj.CheckpointCorruptError,
                     match=r"checkpoint of step 3 .* is corrupt .*restore "
                     r"step 2, the newest intact one") as e:
    ckpt.restore(engine, m.mlp_params())
  assert e.value.intact_step == 2
  assert _equal(engine.gather_params(
      ckpt.restore(engine, m.mlp_params(), step=2)), states[2])
  ckpt.close()


# ------------------------------------------------------------- 3: read-only


def _read_only_prefix(directory: str) -> list[str]:
  """Runs a command with ``directory`` mounted read-only: in a private
  mount namespace as root (permission bits do not stop root), else plain
  (the test makes the directory unwritable)."""
  if os.geteuid() != 0:
    return []
  script = (f"mount --bind {directory} {directory} && mount -o "
            f"remount,bind,ro {directory} && exec \"$@\"")
  return ["unshare", "-rm", "sh", "-c", script, "sh"]


def test_a_read_only_mount_restores_with_read_only(three_steps):
  _, directory, states = three_steps
  expected = np.concatenate([x.ravel() for x in _leaves(states[3])])
  np.save(os.path.join(os.path.dirname(directory), "expected.npy"), expected)
  if os.geteuid() != 0:
    for base, dirs, files in os.walk(directory):
      for name in dirs + files:
        os.chmod(os.path.join(base, name), 0o555)
    os.chmod(directory, 0o555)
  code = _WORKER + textwrap.dedent(f"""
      import numpy as np, jax
      try:
        zj.Checkpointer({directory!r})
      except OSError as e:
        print("WRITABLE-REFUSED", e)
      ckpt = zj.Checkpointer({directory!r}, read_only=True)
      state = ckpt.restore(engine, params)
      got = np.concatenate([np.asarray(x).ravel() for x in
                            jax.tree.leaves(engine.gather_params(state))])
      want = np.load({os.path.dirname(directory) + "/expected.npy"!r})
      print("STEP", int(state.step), "EQUAL", np.array_equal(got, want))
      try:
        ckpt.save(state)
      except PermissionError as e:
        print("SAVE-REFUSED", e)
      ckpt.close()
      """)
  proc = _run_python(code, *_read_only_prefix(directory))
  out = proc.stdout
  assert proc.returncode == 0, out[-2000:] + proc.stderr[-3000:]
  assert "STEP 3 EQUAL True" in out, out
  assert "WRITABLE-REFUSED" in out and "read_only=True" in out, out
  assert "SAVE-REFUSED" in out and "read_only=True" in out, out
  assert sorted(os.listdir(directory)) == ["1", "2", "3"]


def test_read_only_needs_an_existing_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"read_only=True creates "
                     r"nothing"):
    zj.Checkpointer(tmp_path / "missing", read_only=True)
  assert not (tmp_path / "missing").exists()


# ------------------------------------------------------------ 4: checksums


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "bool"])
def test_checksums_ignore_the_layout_and_catch_any_single_flip(dtype):
  """The same numbers from numpy (host memory) and from the jitted program
  (accelerator memory), under any sharding; one flipped bit changes them."""
  # pylint: disable-next=g-import-not-at-top
  from zero_jax.checkpoint import _integrity
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((4, 2), ("a", "b"))
  rng = np.random.default_rng(0)
  x = np.asarray((rng.standard_normal((16, 12)) * 100).astype(dtype))
  layouts = [jax.device_put(x, NamedSharding(mesh, spec))
             for spec in (P("a", "b"), P(None, "a"), P())]
  host = [zj.checkpoint.array_checksums({"w": v}) for v in [x, *layouts]]
  device = [_integrity.checksums_on_device([v]) for v in layouts]
  assert all(h == host[0] for h in host)
  assert all(d == [host[0]["w"]] for d in device), (device, host[0])
  unsigned = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.itemsize])
  for index in [(0, 0), (7, 5), (15, 11)]:
    for bit in range(x.itemsize * 8 if dtype != "bool" else 1):
      y = unsigned.copy()
      y[index] ^= np.array(1 << bit).astype(y.dtype)
      flipped = zj.checkpoint.array_checksums({"w": y.view(x.dtype)})
      assert flipped != host[0], (index, bit)
  # Values that moved (two rows swapped) are caught too.
  swapped = x[[1, 0, *range(2, 16)]]
  if not np.array_equal(swapped, x):
    assert zj.checkpoint.array_checksums({"w": swapped}) != host[0]
