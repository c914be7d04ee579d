"""The one module that reads orbax's internals: ending the threads that a
failed asynchronous save leaves waiting, and running ``Checkpointer``'s exit
hook before Python waits for them.

Why. When the step directory of an asynchronous save cannot be created
(in orbax's background thread), the threads that were to write into it
wait for its "created" signal until orbax's coordination timeout (300 s).
They are not daemons, so the process cannot exit until then. Cancelled and
sent the signal they wait for, they return at once.

Why not a public API. orbax (0.12.8 checked) has none that ends them:
``CheckpointManager`` cannot cancel a save, and cancelling orbax's futures
(``AsyncCheckpointer.cancel``) only flags the threads, which go on
waiting. The public way to not have such threads,
``AsyncOptions(create_directories_asynchronously=False)``, creates the
directories in the blocking part of every save: the failure then comes
from ``save`` rather than in the background, and every save waits for the
file system.

The privates read, each checked by tests/checkpoint/test_orbax.py so that
an orbax upgrade that moves them fails the tests instead of silently
leaving the threads to hang:

- ``orbax.checkpoint._src.futures.synchronization.OperationIdGenerator``
  ``.get_current_operation_id()``: the id of the latest save, with which
  orbax tags the save's threads and names their signals.
- ``orbax.checkpoint._src.futures.future._SignalingThread``: the class of
  those threads; its public ``cancel()``, and its ``_operation_id`` and
  ``_receive_signals`` attributes (the save it belongs to, the signals it
  waits for).
- ``orbax.checkpoint._src.futures.future.set_signals``: sends signals.
- Python's ``threading._register_atexit``: the only hook that runs at exit
  *before* Python joins the non-daemon threads (``atexit`` runs after), so
  that a pending save can be finished, its failure reported and its
  threads released.

Where they are missing, the functions here warn (``RuntimeWarning``) and
do nothing.
"""

# pylint: disable=protected-access,g-import-not-at-top

from __future__ import annotations

import threading
from typing import Any, Callable
import warnings


def _missing(e: BaseException) -> None:
  """Warns that the workaround cannot work with this orbax (Python's
  default filter shows it once)."""
  warnings.warn(
      "zero_jax.Checkpointer: orbax's internals differ from what it expects "
      f"({type(e).__name__}: {e}); a failed asynchronous save may hold the "
      "process at exit for up to 300 s. Install an orbax-checkpoint version "
      "that tests/checkpoint/test_orbax.py passes with.", RuntimeWarning,
      stacklevel=3)


def current_operation_id() -> str | None:
  """The id orbax gave its latest save (its threads are tagged with it),
  or None where orbax's internals differ."""
  try:
    # (Imported here: a moved module must not break ``import zero_jax``.)
    from orbax.checkpoint._src.futures import synchronization
    return synchronization.OperationIdGenerator.get_current_operation_id()
  except (ImportError, AttributeError) as e:
    _missing(e)
    return None


def release_waiting_threads(operation_id: str | None) -> int:
  """Cancels orbax's live threads of the save ``operation_id`` and sends
  each the signals it waits for, so that they return at once.

  Args:
    operation_id: from ``current_operation_id`` once the save started;
      None (unknown) releases nothing.

  Returns:
    How many threads were released.
  """
  if operation_id is None:  # (which threads are the save's is unknown)
    return 0
  try:
    from orbax.checkpoint._src.futures import future
    thread_cls, send = future._SignalingThread, future.set_signals
  except (ImportError, AttributeError) as e:
    _missing(e)
    return 0
  released = 0
  for t in threading.enumerate():
    if not isinstance(t, thread_cls) or not t.is_alive():
      continue
    try:
      if t._operation_id != operation_id:
        continue
      t.cancel()
      send(t._receive_signals, operation_id=operation_id)
    except (AttributeError, TypeError) as e:  # (the internals moved)
      _missing(e)
      continue
    except Exception:  # pylint: disable=broad-except
      # Best effort: the save failed already, and its error is the one to
      # report.
      continue
    released += 1
  return released


def before_threads_join(callback: Callable[[], Any]) -> None:
  """Runs ``callback`` at interpreter exit, before Python joins the
  non-daemon threads (orbax's among them)."""
  register = getattr(threading, "_register_atexit", None)
  if register is None:
    _missing(AttributeError("threading has no _register_atexit"))
    return
  try:
    register(callback)
  except RuntimeError:  # the interpreter is shutting down already
    pass
