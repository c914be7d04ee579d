"""What the processes of a multi-process run agree on around a save: a run
id, the plan of the save, and when a step directory has moved."""

from __future__ import annotations

import uuid

import jax
import numpy as np

from zero_jax.checkpoint import _lineage


def agreed_id() -> str:
  """A new run id, the same in every process (process 0's)."""
  raw = np.frombuffer(uuid.uuid4().bytes, np.int32)
  if jax.process_count() > 1:
    # pylint: disable-next=g-import-not-at-top
    from jax.experimental import multihost_utils
    raw = np.asarray(multihost_utils.broadcast_one_to_all(raw))
  return raw.astype(np.int32).tobytes().hex()


def agreed(plan: _lineage.SavePlan) -> _lineage.SavePlan:
  """Process 0's plan, checked to be every process's (each read the
  directory itself; a file system that shows them different directories
  would have them write different histories)."""
  if jax.process_count() == 1:
    return plan
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental import multihost_utils
  code = np.frombuffer(
      uuid.uuid5(uuid.NAMESPACE_OID, repr(plan)).bytes, np.int32)
  first = np.asarray(multihost_utils.broadcast_one_to_all(code))
  if not np.array_equal(first, code):
    raise RuntimeError(
        f"process {jax.process_index()} sees the checkpoint directory "
        "differently from process 0 (another set of committed steps): every "
        "process must see the same shared directory")
  return plan


def sync(name: str) -> None:
  """Waits for every process (nothing with one)."""
  if jax.process_count() > 1:
    # pylint: disable-next=g-import-not-at-top
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)
