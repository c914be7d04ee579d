"""Measured bytes per device: of a compiled step, a tree, a train state.

``compiled_memory`` (from ``zero_jax._devices``, where the engine's
``remat="auto"`` reads it too) reads XLA's ``memory_analysis()`` of a
compiled step; ``per_device_bytes`` and ``bytes_by_memory_kind`` count what
a tree of (sharded) arrays holds on its busiest device;
``train_state_bytes`` does it for each field of a ``TrainState``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from zero_jax._devices import CompiledMemory, compiled_memory


def per_device_bytes(tree: Any) -> int:
  """Bytes a pytree of (possibly sharded) arrays holds on its busiest device.

  Works on concrete arrays and on ``jax.ShapeDtypeStruct`` with a sharding.
  """
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.shape
    sharding = getattr(x, "sharding", None)
    if sharding is not None:
      shape = sharding.shard_shape(x.shape)
    total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
  return total


def bytes_by_memory_kind(tree: Any) -> dict[str, int]:
  """``per_device_bytes`` split by where each leaf lives: ``{"device": ...,
  "pinned_host": ...}`` (a kind absent from the tree is absent here)."""
  out: dict[str, int] = {}
  for x in jax.tree.leaves(tree):
    kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
    kind = "device" if kind in (None, "device") else kind
    out[kind] = out.get(kind, 0) + per_device_bytes(x)
  return out


def param_count(tree: Any) -> int:
  """Number of elements Ψ in a pytree of arrays."""
  return sum(int(np.prod(np.shape(x), dtype=np.int64))
             for x in jax.tree.leaves(tree))


def train_state_bytes(state: Any) -> dict[str, int]:
  """Per-device bytes of each field of a ``TrainState`` (measured).

  Every dataclass field is reported, so fields ``TrainState`` gains later
  (say a compute-dtype copy of the parameters) appear without a change here.

  Args:
    state: a ``TrainState`` of arrays, or of ``jax.ShapeDtypeStruct`` with
      shardings.

  Returns:
    ``{field name: bytes on the busiest device}``; the values sum to what
    the compiled step takes as its state.
  """
  if not dataclasses.is_dataclass(state) or isinstance(state, type):
    raise TypeError(f"expected a TrainState (a dataclass instance), got "
                    f"{type(state).__name__}")
  return {f.name: per_device_bytes(getattr(state, f.name))
          for f in dataclasses.fields(state)}
