"""The orbax internals that zero_jax/checkpoint/_orbax.py reads are there,
of the kind it expects, and do what it needs: an orbax upgrade that moves
them fails here instead of leaving a failed save's threads to hold the
process at exit (tests/checkpoint/test_checkpoint_faults.py tests that
through ``Checkpointer``)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import threading
import time
from typing import Any

import jax.numpy as jnp
import orbax.checkpoint as ocp
from orbax.checkpoint._src.futures import future, synchronization
import pytest

from zero_jax.checkpoint import _orbax

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
# Orbax's threads would wait 300 s for the signal; released, they end now.
RELEASE_LIMIT_S = 10


# pylint: disable=protected-access


def test_each_private_name_read_is_there_with_its_kind():
  generator = synchronization.OperationIdGenerator
  assert inspect.isclass(generator)
  assert isinstance(inspect.getattr_static(
      generator, "get_current_operation_id"), classmethod)
  assert isinstance(generator.get_current_operation_id(), str)
  thread_cls = future._SignalingThread
  assert inspect.isclass(thread_cls)
  assert issubclass(thread_cls, threading.Thread)
  assert inspect.isfunction(thread_cls.cancel)
  assert inspect.isfunction(future.set_signals)
  params = inspect.signature(future.set_signals).parameters
  assert list(params) == ["send_signals", "operation_id"], params
  assert params["operation_id"].kind is inspect.Parameter.KEYWORD_ONLY
  # (The hook that runs before Python joins the non-daemon threads.)
  assert callable(threading._register_atexit)


def _save_whose_directory_fails(directory: str) -> ocp.CheckpointManager:
  """An asynchronous orbax save of step 0 whose step directory cannot be
  created (in orbax's background thread): a dangling link stands where
  orbax's temporary directory goes."""
  manager = ocp.CheckpointManager(
      directory, item_handlers=ocp.StandardCheckpointHandler(),
      options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True,
                                           create=True))
  os.symlink(os.path.join(directory, "nowhere"),
             os.path.join(directory, "0.orbax-checkpoint-tmp"))
  assert manager.save(0, args=ocp.args.StandardSave({"x": jnp.ones(4)}))
  return manager


def _threads_of(operation_id: str) -> list[Any]:
  return [t for t in threading.enumerate()
          if isinstance(t, future._SignalingThread) and t.is_alive()
          and t._operation_id == operation_id]


def _waits_for_the_directory(t: Any) -> bool:
  return (synchronization.HandlerAwaitableSignal.STEP_DIRECTORY_CREATION
          in t._receive_signals)


def test_a_failed_saves_threads_wait_until_released(tmp_path):
  manager = _save_whose_directory_fails(str(tmp_path))
  operation_id = _orbax.current_operation_id()
  try:  # (released in any case: they would hold pytest's exit for 300 s)
    assert isinstance(operation_id, str)
    # Until the thread that creates the directory has failed and ended.
    deadline = time.time() + RELEASE_LIMIT_S
    waiting = _threads_of(operation_id)
    while (not all(map(_waits_for_the_directory, waiting)) and
           time.time() < deadline):
      time.sleep(0.05)
      waiting = _threads_of(operation_id)
    # The attributes read, on live threads of a real save: each waits for
    # the step directory's signal, which will never come.
    assert waiting, "no orbax thread waits for the failed save"
    for t in waiting:
      signals = t._receive_signals
      assert all(isinstance(s, synchronization.HandlerAwaitableSignal)
                 for s in signals), signals
      assert _waits_for_the_directory(t), (t.name, signals)
  finally:
    released = _orbax.release_waiting_threads(operation_id)
  assert released == len(waiting)
  deadline = time.time() + RELEASE_LIMIT_S
  while any(t.is_alive() for t in waiting) and time.time() < deadline:
    time.sleep(0.05)
  assert not [t.name for t in waiting if t.is_alive()]
  with pytest.raises(FileExistsError, match="0.orbax-checkpoint-tmp"):
    manager.wait_until_finished()
  manager.close()


def test_an_unknown_save_releases_nothing():
  assert _orbax.release_waiting_threads(None) == 0
  assert _orbax.release_waiting_threads("no such operation") == 0


def test_missing_internals_warn_and_do_nothing(monkeypatch):
  monkeypatch.delattr(future, "_SignalingThread")
  with pytest.warns(RuntimeWarning, match=r"orbax's internals differ .*"
                    r"_SignalingThread.*300 s"):
    assert _orbax.release_waiting_threads("0") == 0


def test_the_exit_hook_runs_before_python_joins_the_threads():
  # A non-daemon thread that ends only when the hook has run: with a hook
  # that ran after the join (as atexit's do), the exit would wait 60 s.
  script = (
      "import threading, time\n"
      "from zero_jax.checkpoint._orbax import before_threads_join\n"
      "go = threading.Event()\n"
      "threading.Thread(target=go.wait, args=(60,)).start()\n"
      "def hook():\n"
      "  print('HOOK', time.time(), flush=True)\n"
      "  go.set()\n"
      "before_threads_join(hook)\n"
      "print('END', time.time(), flush=True)\n")
  proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT,
                        env=dict(os.environ, PYTHONPATH=ROOT),
                        capture_output=True, text=True, timeout=180)
  assert proc.returncode == 0, proc.stderr[-3000:]
  words = proc.stdout.split()
  assert words[::2] == ["END", "HOOK"], proc.stdout
  # (Timed inside the process: importing JAX under load takes a while.)
  assert float(words[3]) - float(words[1]) < 30, "the hook ran after the join"
