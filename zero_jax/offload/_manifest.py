"""The NVMe tier's manifest: the one file that names the committed version
of the state files, the step, the small state and every request's
checksum. It is replaced whole (written aside, flushed, renamed, the
directory flushed), so a process killed at any point leaves the old one
or the new one, never a part."""

from __future__ import annotations

import json
import os
import pathlib

import jax.numpy as jnp
import numpy as np

from zero_jax.offload import _disk

MANIFEST = "manifest.json"
FORMAT = 1


def read_manifest(root: pathlib.Path) -> dict | None:
  """The committed record under ``root`` (None: nothing committed)."""
  path = root / MANIFEST
  try:
    text = path.read_text()
  except FileNotFoundError:
    return None
  try:
    record = json.loads(text)
  except json.JSONDecodeError as e:
    raise _disk.DiskError(
        5, f"{path} is not the NVMe tier's manifest ({e}): the directory "
        "is damaged; use another nvme_path and restore from a checkpoint"
    ) from e
  if not isinstance(record, dict) or record.get("format") != FORMAT:
    raise _disk.DiskError(
        5, f"{path} is not a manifest of this zero_jax's NVMe tier (format "
        f"{FORMAT}); use another nvme_path")
  return record


def write_manifest(root: pathlib.Path, record: dict) -> None:
  """Commits ``record``: written aside, flushed, renamed over the manifest,
  the directory flushed."""
  aside = root / (MANIFEST + ".new")
  with open(aside, "w") as f:
    json.dump(record, f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(aside, root / MANIFEST)
  _disk.sync_directory(root)


def encode(leaves: list) -> list:
  """Small arrays as JSON: [dtype, shape, values]."""
  out = []
  for x in leaves:
    x = np.asarray(x)
    out.append([x.dtype.name, list(x.shape), x.reshape(-1).tolist()])
  return out


def decode(rows: list) -> list[np.ndarray]:
  """``encode``'s rows as arrays."""
  return [np.array(v, dtype=jnp.dtype(d)).reshape(s) for d, s, v in rows]
