"""The newest checkpoint this process saved or restored.

``zero_jax.checkpoint`` records it; an error raised elsewhere (a step that
failed at run time and took its donated state with it) names it as the
place to resume from. It lives here, at the top, because ``train`` comes
before ``checkpoint`` in the package's order and must not import it.
"""

from __future__ import annotations

import dataclasses
import threading


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
