"""Faults around checkpoints: each is an exception that says what happened
and what to do, the checkpoints committed before stay intact, and the
process exits."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import time
from typing import Any

import optax
import pytest

import zero_jax as zj
from tests import _models as m
from zero_jax.checkpoint import CheckpointWriteError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
EXIT_LIMIT_S = 60  # orbax's stuck threads would hold the exit for 300 s


@functools.cache
def _engine(tx: Any = None) -> zj.Engine:
  """Stage 3 on 8 devices (AdamW unless ``tx``); one engine per optimizer
  object, shared by the tests (it holds no training state)."""
  return zj.Engine(m.mlp_loss, tx or optax.adamw(1e-2),
                   zj.ZeroConfig(stage=3, min_shard_elements=0),
                   zj.make_mesh(8))


def _run(args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
  """Runs ``python ARGS`` from the repository root; returns the finished
  process and how long it took to exit."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # (the worker asks for its 8 devices)
  start = time.time()
  try:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True,
                          timeout=EXIT_LIMIT_S)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"the process did not exit within {EXIT_LIMIT_S} s: "
                f"{(e.stdout or b'')[-3000:]!r}")
  return proc, time.time() - start


def _worker(mode: str, directory: str) -> list[str]:
  """Runs the fault worker in MODE; returns its report lines."""
  proc, _ = _run(["-m", "tests.checkpoint._checkpoint_fault_worker", mode,
                  directory])
  log = proc.stdout + proc.stderr
  assert proc.returncode == 0, log[-3000:]
  lines = [l for l in proc.stdout.splitlines()
           if l.startswith(("SAVED", "ERROR", "STEPS", "DONE"))]
  assert lines and lines[-1] == "DONE", log[-3000:]
  return lines + [l for l in proc.stderr.splitlines()
                  if l.startswith("zero_jax")]


def _assert_only_step_1_restores(directory: str) -> None:
  engine = _engine()
  with zj.Checkpointer(directory) as ckpt:
    assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1
    assert int(ckpt.restore(engine, m.mlp_params()).step) == 1


# ------------------------------------------- 1: a save that fails to write


def test_a_write_failing_in_the_background_is_raised_by_wait(tmp_path):
  # Data files fail to write (as on a full disk) after save() returned.
  directory = str(tmp_path / "ckpt")
  lines = _worker("disk_full", directory)
  assert lines[0] == "SAVED True", lines
  error = lines[1]
  assert error.startswith("ERROR CheckpointWriteError: "), lines
  for words in ("step 2", repr(directory), "failed in the background",
                "File too large", "kept: [1]", "another directory"):
    assert words in error, error
  # Reported once, by wait; step 1, which step 2 was to replace
  # (max_to_keep=1), is still listed.
  assert lines[2:] == ["STEPS [1]", "DONE"], lines
  _assert_only_step_1_restores(directory)


def test_a_step_directory_that_cannot_be_created_does_not_hold_the_exit(
    tmp_path):
  # Orbax's writer threads would wait 300 s for the missing directory.
  directory = str(tmp_path / "ckpt")
  lines = _worker("no_step_directory", directory)
  assert lines[0] == "SAVED True", lines
  assert lines[1].startswith("ERROR CheckpointWriteError: "), lines
  for words in ("step 2", repr(directory), "FileExistsError"):
    assert words in lines[1], lines[1]
  os.remove(os.path.join(directory, "2.orbax-checkpoint-tmp"))
  _assert_only_step_1_restores(directory)


def test_a_failed_save_never_waited_for_is_reported_at_exit(tmp_path):
  directory = str(tmp_path / "ckpt")
  lines = _worker("never_waits", directory)
  assert lines[:2] == ["SAVED True", "DONE"], lines
  assert lines[2].startswith("zero_jax.Checkpointer at exit: saving the "
                             "checkpoint of step 2"), lines


def test_a_directory_gone_after_construction_fails_at_save(tmp_path):
  directory = tmp_path / "ckpt"
  engine = _engine()
  state = engine.init(m.mlp_params())
  ckpt = zj.Checkpointer(directory)
  shutil.rmtree(directory)
  directory.write_text("a file now")
  with pytest.raises(CheckpointWriteError,
                     match=r"step 0 .*could not start.*not a directory") as e:
    ckpt.save(state, engine=engine)
  assert e.value.step == 0 and e.value.directory == str(directory)
  ckpt.close()


# --------------------------------------- 2: a directory that is unusable


def test_a_file_as_the_directory_is_an_error_at_construction(tmp_path):
  path = tmp_path / "a_file"
  path.write_text("not a directory")
  with pytest.raises(NotADirectoryError,
                     match=r"a_file' exists and is not a directory.*move"):
    zj.Checkpointer(path)
  with pytest.raises(OSError, match=r"under' cannot be written.*another"):
    zj.Checkpointer(path / "under")
  assert path.read_text() == "not a directory"
  # The process reports it and exits (orbax used to hang at exit).
  proc, seconds = _run(["-c", "import zero_jax as zj; "
                        f"zj.Checkpointer({str(path)!r})"])
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "NotADirectoryError" in proc.stderr, proc.stderr[-3000:]
  assert seconds < EXIT_LIMIT_S


# ------------------------------------- 3: directories that look like steps


def test_only_committed_zero_jax_checkpoints_are_steps(tmp_path):
  engine = _engine()
  state = engine.init(m.mlp_params())
  with zj.Checkpointer(tmp_path) as ckpt:
    ckpt.save(state, engine=engine)
  (tmp_path / "7").mkdir()  # e.g. made by hand
  # A copy without orbax's commit marker: an interrupted save.
  shutil.copytree(tmp_path / "0", tmp_path / "8")
  (tmp_path / "8" / "commit_success.txt").unlink()
  (tmp_path / "8" / "_CHECKPOINT_METADATA").unlink()
  # Orbax's items without zero_jax's metadata: another program's.
  shutil.copytree(tmp_path / "0", tmp_path / "9")
  shutil.rmtree(tmp_path / "9" / "meta")
  # Orbax's max_to_keep would count them and delete the real checkpoints.
  with pytest.raises(FileExistsError, match=r"not committed zero_jax "
                     r"checkpoints: \[7, 8, 9\].*delete real ones"):
    zj.Checkpointer(tmp_path, max_to_keep=2)
  assert sorted(os.listdir(tmp_path)) == ["0", "7", "8", "9"]
  with zj.Checkpointer(tmp_path, max_to_keep=None) as ckpt:
    assert ckpt.all_steps() == [0] and ckpt.latest_step() == 0
    assert int(ckpt.restore(engine, m.mlp_params()).step) == 0
    for step in (7, 8, 9):
      with pytest.raises(FileNotFoundError,
                         match=rf"{step}' is not a committed zero_jax "
                         r"checkpoint .*restore one of \[0\]"):
        ckpt.restore(engine, m.mlp_params(), step=step)
  # A save does not take such a directory for its step's checkpoint.
  (tmp_path / "other" / "0").mkdir(parents=True)
  with zj.Checkpointer(tmp_path / "other", max_to_keep=None) as ckpt:
    assert ckpt.latest_step() is None
    with pytest.raises(FileExistsError,
                       match=r"0' exists but is not a committed zero_jax "
                       r"checkpoint .*move or delete it"):
      ckpt.save(state)


# ------------------------------------------- 4: another optimizer's state


@pytest.mark.parametrize("tx,words", [
    (optax.adamw(1e-2), ["opt_state/2 (a part without arrays) is missing",
                         "(ScaleByAdamState(count, mu, nu), EmptyState())",
                         "EmptyState(), EmptyState())"]),
    (optax.sgd(0.1, momentum=0.9), ["opt_state/0/trace/b1 is missing",
                                    "(TraceState(trace), EmptyState())"]),
])
def test_another_optimizer_is_named_not_called_corrupt(tmp_path, tx, words):
  adam = _engine(optax.adam(1e-2))
  with zj.Checkpointer(tmp_path) as ckpt:
    ckpt.save(adam.init(m.mlp_params()), engine=adam)
    ckpt.wait()
    with pytest.raises(ValueError, match="another optimizer") as e:
      ckpt.restore(_engine(tx), m.mlp_params())
  message = str(e.value)
  for w in words + ["step 0", "saved at stage 3",
                    "Restore with the optimizer it was saved with",
                    "start this engine's optimizer state fresh"]:
    assert w in message, message
  assert "corrupt" not in message
