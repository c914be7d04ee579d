"""A step that fails at run time, explained the moment it fails.

JAX dispatches a step and returns at once; an error of its execution (out
of memory, a failed collective, a callback that raised) surfaces where the
caller first reads a result, as JAX's bare error, which cannot say that
the state given to the step was donated. One thread of this module waits
for every dispatched step in turn, and prints the explanation to stderr as
soon as one fails: what the step took with it and what to do.
``engine.step`` raises it as ``StepFailedError`` at the next call.
"""

from __future__ import annotations

import atexit
import queue
import sys
import threading
import time
from typing import Any, Callable

import jax

_QUEUE: queue.SimpleQueue = queue.SimpleQueue()
_THREAD: list[threading.Thread] = []
_LOCK = threading.Lock()
_STOPPING = threading.Event()
_POLL_S = 0.02


def watch(outputs: Any, explain: Callable[[BaseException], str]) -> None:
  """Prints ``explain(error)`` to stderr if computing ``outputs`` (a
  step's small results) fails; nothing otherwise. Steps after a failed one
  inherit its error and are not explained again."""
  with _LOCK:
    if not (_THREAD and _THREAD[0].is_alive()):  # (none yet, or forked)
      if not _THREAD:
        # (A thread still holding JAX's arrays as the interpreter ends
        # aborts the process: it stops, and lets go, first.)
        atexit.register(_stop)
      _THREAD[:] = [threading.Thread(target=_run, daemon=True,
                                     name="zero_jax-step-watch")]
      _THREAD[0].start()
  _QUEUE.put((outputs, explain))


def _stop() -> None:
  _STOPPING.set()
  _QUEUE.put(None)
  _THREAD[0].join(timeout=5)


def _run() -> None:
  failed = False  # (the last step watched failed)
  while True:
    item = _QUEUE.get()
    if item is None:
      return
    outputs, explain = item
    try:
      while not all(x.is_ready() for x in jax.tree.leaves(outputs)):
        if _STOPPING.is_set():
          return
        time.sleep(_POLL_S)
      jax.block_until_ready(outputs)  # (ready: its error, if any, at once)
      failed = False
    except jax.errors.JaxRuntimeError as e:
      if not failed:
        print(explain(e), file=sys.stderr, flush=True)
      failed = True
    except Exception:  # pylint: disable=broad-except
      failed = True  # (deleted outputs: the caller's, not a failure)
    del outputs, explain
