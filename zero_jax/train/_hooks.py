"""What the train step announces, and what later layers plug into it.

``train`` comes before ``checkpoint`` and ``distributed`` in the package's
order and imports neither: they register here.

- ``add_step_listener(fn)``: ``fn()`` runs at every ``step_done()``, which
  ``Engine.step`` calls once per step (a training loop without the engine
  calls it itself, as ``zero_jax.distributed.step_done``).
  ``zero_jax.distributed``'s fail-fast listens while armed.
- ``set_last_checkpoint(hint)``: ``hint()`` says how to resume from the
  newest checkpoint this process saved or restored (None: none); a step
  that failed at run time names it. ``zero_jax.checkpoint`` sets it when
  it records a checkpoint (no checkpoint recorded: nothing to name).
- ``set_abort_probe(probe)``: ``probe(client)`` is the error another
  process published when it failed, or None; the processes' batch check
  (``_agreement``) stops waiting for the others on it.
  ``zero_jax.distributed``'s fail-fast, which publishes failures, sets it
  while armed (unarmed here, it is unarmed in the job's other processes,
  which run the same script: none publishes a failure).

``step_done()`` also touches the heartbeat file of ``python -m
zero_jax.launch --watchdog`` (``ENV_HEARTBEAT_FILE``; at most once a
second, the launcher's runner creates it, with mtime 0, before the script
starts), so the launcher can tell a hung job from a slow one. That is not
a listener: a script under the watchdog need never import
``zero_jax.distributed``, and its steps must be seen all the same.

Only the standard library, and nothing is set up until a step reports or
a later layer registers.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

# Set by ``python -m zero_jax.launch --watchdog`` for each process: the file
# whose mtime says when the process last finished a step.
ENV_HEARTBEAT_FILE = "ZERO_JAX_HEARTBEAT_FILE"
# The file is touched at most this often: a step costs at most one
# time.monotonic() call in between.
_SECONDS = 1.0

_due = 0.0  # time.monotonic() of the next touch
_listeners: list[Callable[[], None]] = []
_last_checkpoint: Callable[[], str | None] = lambda: None
_abort_probe: Callable[[Any], str | None] = lambda client: None


def add_step_listener(fn: Callable[[], None]) -> Callable[[], None]:
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


def set_last_checkpoint(hint: Callable[[], str | None]) -> None:
  """``hint()`` says how to resume from the newest checkpoint (None:
  none)."""
  global _last_checkpoint
  _last_checkpoint = hint


def last_checkpoint() -> str | None:
  """How to resume from the newest checkpoint this process saved or
  restored, or None."""
  return _last_checkpoint()


def set_abort_probe(
    probe: Callable[[Any], str | None]) -> Callable[[], None]:
  """``probe(client)``: the error another process published on failing
  (through JAX's coordination-service ``client``), or None. Returns the
  function that puts the previous probe back."""
  global _abort_probe
  previous, _abort_probe = _abort_probe, probe

  def restore() -> None:
    global _abort_probe
    if _abort_probe is probe:
      _abort_probe = previous

  return restore


def published_failure(client: Any) -> str | None:
  """The error another process published on failing, or None."""
  return _abort_probe(client)
