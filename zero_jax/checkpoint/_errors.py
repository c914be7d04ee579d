"""The errors a checkpoint can end in: a save that failed, a save that
would mix two histories, and bytes that are not what was saved."""

from __future__ import annotations


class CheckpointWriteError(OSError):
  """Saving a checkpoint failed; the checkpoints committed before are intact.

  Raised by ``Checkpointer.save`` when the directory cannot take the
  checkpoint, and by the next ``save``, ``wait`` or ``close`` when an
  asynchronous save failed in the background (a full disk, a lost
  permission, a file system error). ``step`` and ``directory`` say which
  save; ``__cause__`` is the error underneath.
  """

  def __init__(self, message: str, step: int, directory: str):
    super().__init__(message)
    self.step = step
    self.directory = directory


class CheckpointConflictError(FileExistsError):
  """A save would mix two histories in one directory: it holds checkpoints
  of another run (a second job writing there, or a run this one did not
  restore from), or a different state of the same step. Nothing was
  written; the message names the steps, their writer and the fixes.
  ``step`` and ``directory`` say which save."""

  def __init__(self, message: str, step: int, directory: str):
    super().__init__(message)
    self.step = step
    self.directory = directory


class CheckpointCorruptError(ValueError):
  """A checkpoint's bytes are not what was saved: an array's checksum
  differs, or orbax could not decode it. ``step`` is the corrupt one,
  ``leaves`` the leaves found wrong, with the files that hold them
  (``files``), and ``intact_step`` the newest step that restores intact
  (None if none does)."""

  def __init__(self, message: str, step: int, leaves: list[str],
               files: list[str], intact_step: int | None):
    super().__init__(message)
    self.step = step
    self.leaves = leaves
    self.files = files
    self.intact_step = intact_step
