"""Measured bytes per device: of a compiled step, a tree, a train state.

``compiled_memory`` reads XLA's ``memory_analysis()`` of a compiled step;
``per_device_bytes`` and ``bytes_by_memory_kind`` count what a tree of
(sharded) arrays holds on its busiest device; ``train_state_bytes`` does it
for each field of a ``TrainState``. All are re-exported by
``zero_jax.memory``, next to the analytic estimates they are checked against.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
  """Per-device bytes of a compiled step (from ``memory_analysis()``).

  Attributes:
    argument: bytes of all inputs (train state and batch).
    output: bytes of all outputs.
    temp: scratch bytes live during the step.
    alias: bytes of outputs that reuse donated inputs.
    host: bytes in host memory (``pinned_host``: offloaded arguments,
      outputs and scratch); not part of ``peak``. Only programs compiled
      for devices with host memory kinds (GPUs, TPUs) report any.
  """

  argument: int
  output: int
  temp: int
  alias: int
  host: int = 0

  @property
  def peak(self) -> int:
    """argument + output + temp - alias. (On CPU, ``peak_memory_in_bytes``
    leaves out temp, so it is recomputed here.)"""
    return self.argument + self.output + self.temp - self.alias


def compiled_memory(compiled) -> CompiledMemory:
  """Reads per-device byte counts off a compiled (``.compile()``) function."""
  ma = compiled.memory_analysis()
  host = lambda name: int(getattr(ma, f"host_{name}_size_in_bytes", 0) or 0)
  return CompiledMemory(argument=int(ma.argument_size_in_bytes),
                        output=int(ma.output_size_in_bytes),
                        temp=int(ma.temp_size_in_bytes),
                        alias=int(ma.alias_size_in_bytes),
                        host=(host("argument") + host("output") +
                              host("temp") - host("alias")))


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
