"""Memory per device: the paper's formulas and what the compiled step uses.

The paper (arXiv:1910.02054, section 5) counts model-state bytes per device
for Ψ parameters on N devices, with 2-byte params and gradients and K bytes
of optimizer state per parameter (K = 12 for mixed-precision Adam). For fp32
training params and gradients are 4 bytes and K = 8 (Adam's two moments).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np


def paper_model_state_bytes(psi: float, n: int, stage: int, *,
                            param_bytes: int = 2, grad_bytes: int = 2,
                            k: int = 12) -> float:
  """Per-device model-state bytes of the ZeRO paper's formula.

  Args:
    psi: parameter count Ψ.
    n: data-parallel devices N.
    stage: 0 (plain DP), 1 (P_os), 2 (P_os+g), 3 (P_os+g+p).
    param_bytes: bytes per parameter (2 for fp16/bf16 compute, 4 for fp32).
    grad_bytes: bytes per gradient element.
    k: optimizer-state bytes per parameter (12 for mixed-precision Adam,
      8 for fp32 Adam).

  Returns:
    Bytes per device.
  """
  p, g, o = param_bytes * psi, grad_bytes * psi, k * psi
  if stage == 0:
    return p + g + o
  if stage == 1:
    return p + g + o / n
  if stage == 2:
    return p + (g + o) / n
  if stage == 3:
    return (p + g + o) / n
  raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
  """Per-device bytes of a compiled step (from ``memory_analysis()``).

  Attributes:
    argument: bytes of all inputs (train state and batch).
    output: bytes of all outputs.
    temp: scratch bytes live during the step.
    alias: bytes of outputs that reuse donated inputs.
  """

  argument: int
  output: int
  temp: int
  alias: int

  @property
  def peak(self) -> int:
    """argument + output + temp - alias. (On CPU, ``peak_memory_in_bytes``
    leaves out temp, so it is recomputed here.)"""
    return self.argument + self.output + self.temp - self.alias


def compiled_memory(compiled) -> CompiledMemory:
  """Reads per-device byte counts off a compiled (``.compile()``) function."""
  ma = compiled.memory_analysis()
  return CompiledMemory(argument=int(ma.argument_size_in_bytes),
                        output=int(ma.output_size_in_bytes),
                        temp=int(ma.temp_size_in_bytes),
                        alias=int(ma.alias_size_in_bytes))


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


def param_count(tree: Any) -> int:
  """Number of elements Ψ in a pytree of arrays."""
  return sum(int(np.prod(np.shape(x), dtype=np.int64))
             for x in jax.tree.leaves(tree))
