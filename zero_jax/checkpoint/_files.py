"""What ``Checkpointer`` needs of the file system and of orbax's threads.

Whether a step directory is committed, whether a directory can take a
checkpoint, and the clean-up of a failed asynchronous save (orbax's
threads that would otherwise hold the process at exit).
"""

from __future__ import annotations

import errno
import json
import os
import sys
import tempfile
import threading
from typing import Any
import weakref

from etils import epath


# Orbax's commit marker in a step directory (orbax >= 0.11.1 writes it for
# every checkpoint; earlier versions only on file systems without rename).
COMMIT_FILE = "commit_success.txt"


def commit_time(path: epath.Path) -> bool:
  """Whether orbax's step metadata records a commit (it is written when a
  checkpoint is finalized, just before the rename that commits it)."""
  try:
    meta = json.loads((path / "_CHECKPOINT_METADATA").read_text())
  except (OSError, ValueError):
    return False
  return bool(isinstance(meta, dict) and meta.get("commit_timestamp_nsecs"))


def check_usable(directory: str) -> None:
  """Raises an OSError naming the fix unless ``directory`` is, or can be
  made, a directory this process can write into.

  The test writes: permission bits say nothing for root, a read-only mount
  or a full quota.
  """
  path = os.path.abspath(directory)
  if os.path.exists(path) and not os.path.isdir(path):
    raise NotADirectoryError(
        errno.ENOTDIR, f"the checkpoint directory {directory!r} exists and "
        "is not a directory; pass a directory (it is created if missing) or "
        "move the file away")
  try:
    os.makedirs(path, exist_ok=True)
    os.rmdir(tempfile.mkdtemp(prefix=".zero_jax-probe-", dir=path))
  except OSError as e:
    raise OSError(
        e.errno, f"the checkpoint directory {directory!r} cannot be written "
        f"({e.strerror or e}: {e.filename or path}); create it and make it "
        "writable by this process, or pass another directory") from e


def operation_id() -> str | None:
  """The id orbax gave its latest save (its threads are tagged with it)."""
  try:
    from orbax.checkpoint._src.futures import synchronization  # pylint: disable=g-import-not-at-top
    return synchronization.OperationIdGenerator.get_current_operation_id()
  except Exception:  # pylint: disable=broad-except  # (orbax internals)
    return None


def release_orbax_threads(operation_id: str | None) -> None:
  """Ends orbax's threads of a failed save that still wait for a signal.

  When the step directory of an asynchronous save cannot be created, the
  threads that write into it keep waiting for its "created" signal until
  orbax's coordination timeout (300 s); they are not daemons, so the
  process cannot exit until then. Cancelled and signalled, they return at
  once. Best effort: this reaches into orbax's internals, and does nothing
  where they differ.
  """
  if operation_id is None:  # (which threads are the save's is unknown)
    return
  try:
    from orbax.checkpoint._src.futures import future  # pylint: disable=g-import-not-at-top
    thread_cls = future._SignalingThread  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-except
    return
  for t in threading.enumerate():
    op = getattr(t, "_operation_id", None)
    if (not isinstance(t, thread_cls) or not t.is_alive() or
        op != operation_id):
      continue
    try:
      t.cancel()
      future.set_signals(t._receive_signals, operation_id=op)  # pylint: disable=protected-access
    except Exception:  # pylint: disable=broad-except
      pass


def at_thread_shutdown(ckpt: Any) -> None:
  """At interpreter exit, before Python joins the threads, waits for the
  pending save of ``ckpt`` (a ``Checkpointer``) and reports a failure on
  stderr.

  A program that never calls ``wait`` or ``close`` would otherwise lose a
  failed save's error, and hang in the join if the failure left orbax's
  threads waiting.
  """
  ref = weakref.ref(ckpt)

  def at_exit() -> None:
    c = ref()
    if c is None or c._pending is None:  # pylint: disable=protected-access
      return
    try:
      c._finish()  # pylint: disable=protected-access
    except Exception as e:  # pylint: disable=broad-except
      print(f"zero_jax.Checkpointer at exit: {e}", file=sys.stderr,
            flush=True)

  register = getattr(threading, "_register_atexit", None)  # Python >= 3.9
  if register is not None:
    try:
      register(at_exit)
    except RuntimeError:  # the interpreter is shutting down already
      pass
