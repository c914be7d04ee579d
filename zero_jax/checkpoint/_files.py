"""What ``Checkpointer`` needs of the file system: whether a step
directory is committed, and whether a directory can take a checkpoint."""

from __future__ import annotations

import errno
import json
import os
import tempfile

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
        "writable by this process, or pass another directory (to restore "
        "only, e.g. from a read-only mount: Checkpointer(directory, "
        "read_only=True))") from e
