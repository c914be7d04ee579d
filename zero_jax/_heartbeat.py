"""Training progress, announced to whoever watches this process.

``step_done()`` is called once per training step (``Engine.step`` does).
Under ``python -m zero_jax.launch --watchdog`` it touches the file the
launcher names in ``ZERO_JAX_HEARTBEAT_FILE`` (at most once a second; the
launcher's runner creates it, with mtime 0, before the script starts), so
the launcher can tell a hung job from a slow one; listeners added with
``add_listener`` (``zero_jax.distributed``'s fail-fast, while armed) run on
every call. It is re-exported as ``zero_jax.distributed.step_done``.

Only the standard library: nothing here is imported or set up until a step
reports, so importing the package changes nothing in the process.
"""

from __future__ import annotations

import os
import time
from typing import Callable

# Set by ``python -m zero_jax.launch --watchdog`` for each process: the file
# whose mtime says when the process last finished a step.
ENV_HEARTBEAT_FILE = "ZERO_JAX_HEARTBEAT_FILE"
# The file is touched at most this often: a step costs at most one
# time.monotonic() call in between.
_SECONDS = 1.0

_due = 0.0  # time.monotonic() of the next touch
_listeners: list[Callable[[], None]] = []


def add_listener(fn: Callable[[], None]) -> Callable[[], None]:
  """Runs ``fn()`` at every ``step_done``; returns the function that
  removes it."""
  _listeners.append(fn)
  return lambda: _listeners.remove(fn) if fn in _listeners else None


def step_done() -> None:
  """Reports that this process finished a training step.

  ``Engine.step`` calls it once per step; a training loop that does not use
  the engine calls it itself. It feeds the watchdog of ``python -m
  zero_jax.launch --watchdog SECONDS``, which ends a job whose processes go
  that long without a step. Costs one ``time.monotonic()`` call per step, a
  file touch at most once a second, and nothing more when the launcher's
  watchdog is off.
  """
  global _due
  for fn in tuple(_listeners):
    fn()
  path = os.environ.get(ENV_HEARTBEAT_FILE)
  if not path:
    return
  now = time.monotonic()
  if now < _due:
    return
  _due = now + _SECONDS
  try:
    os.utime(path)
  except OSError:
    pass  # (the launcher removed it: it is ending the job)
