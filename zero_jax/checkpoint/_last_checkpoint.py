"""The newest checkpoint this process saved or restored.

``Checkpointer`` records it; a step that failed at run time (and took its
donated state with it) names it as the place to resume from. ``train``
comes before ``checkpoint`` and cannot ask for it: the first record hands
``zero_jax.train``'s hooks the hint to name (``set_last_checkpoint``).
"""

from __future__ import annotations

import dataclasses
import threading

from zero_jax.train import set_last_checkpoint


@dataclasses.dataclass(frozen=True)
class CheckpointRecord:
  """A checkpoint known to be complete: where, and which step."""

  directory: str
  step: int

  def restore_hint(self) -> str:
    """How to resume from it, for an error message."""
    return (f"the last checkpoint is step {self.step} in "
            f"{self.directory!r}: resume with zero_jax.Checkpointer("
            f"{self.directory!r}).restore(engine, params, step={self.step})")


_lock = threading.Lock()
_last: CheckpointRecord | None = None


def record(directory: str, step: int) -> None:
  """Notes that ``step`` in ``directory`` is complete (committed or just
  restored)."""
  global _last
  with _lock:
    _last = CheckpointRecord(directory, int(step))
  set_last_checkpoint(restore_hint)


def forget(directory: str) -> None:
  """Forgets the record if it points into ``directory`` (its checkpoints
  were moved or it was closed as unusable)."""
  global _last
  with _lock:
    if _last is not None and _last.directory == directory:
      _last = None


def last() -> CheckpointRecord | None:
  """The newest checkpoint recorded in this process, or None."""
  with _lock:
    return _last


def restore_hint() -> str | None:
  """How to resume from the newest checkpoint recorded, or None."""
  newest = last()
  return None if newest is None else newest.restore_hint()
