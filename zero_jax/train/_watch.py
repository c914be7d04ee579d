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

import queue
import sys
import threading
from typing import Any, Callable

import jax

_QUEUE: queue.SimpleQueue = queue.SimpleQueue()
_THREAD: list[threading.Thread] = []
_LOCK = threading.Lock()


def watch(outputs: Any, explain: Callable[[BaseException], str]) -> None:
  """Prints ``explain(error)`` to stderr if computing ``outputs`` (a
  step's small results) fails; nothing otherwise. Steps after a failed one
  inherit its error and are not explained again."""
  with _LOCK:
    if not _THREAD:
      _THREAD.append(threading.Thread(target=_run, daemon=True,
                                      name="zero_jax-step-watch"))
      _THREAD[0].start()
  _QUEUE.put((outputs, explain))


def _run() -> None:
  failed = False  # (the last step watched failed)
  while True:
    outputs, explain = _QUEUE.get()
    try:
      jax.block_until_ready(outputs)
      failed = False
    except jax.errors.JaxRuntimeError as e:
      if not failed:
        print(explain(e), file=sys.stderr, flush=True)
      failed = True
    except Exception:  # pylint: disable=broad-except
      failed = True  # (deleted outputs: the caller's, not a failure)
    del outputs, explain
