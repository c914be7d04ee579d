"""ZeRO configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from zero_jax.layers import REMAT_POLICIES

_STAGES = (0, 1, 2, 3)


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
  """How a model is laid out and trained over the ``data`` axis of a mesh.

  Attributes:
    stage: ZeRO stage. 0: plain data parallelism (everything replicated,
      gradients all-reduced). 1: optimizer state and fp32 master weights
      sharded, gradients reduce-scattered after backward. 2: as 1, but each
      gradient leaf is reduce-scattered as soon as backward produces it.
      3: parameters sharded too and all-gathered where they are used.
    min_shard_elements: leaves with fewer elements than this are replicated
      rather than sharded (the gather would cost more than the memory saved;
      DeepSpeed calls this ``stage3_param_persistence_threshold``). Every such
      leaf is listed by ``Engine.describe()``.
    seed: seed of the per-step, per-device PRNG key handed to ``loss_fn``
      when the engine is built with ``with_rng=True``.
    remat: rematerialization policy of each layer run by
      ``zero_jax.scan_layers``: ``"full"`` (save nothing, recompute the layer
      and re-gather its parameters in backward; the default), ``"none"``
      (keep everything, including stage 3's gathered parameters), or
      ``"dots_saveable"`` (keep matmul outputs, not gathered parameters).
  """

  stage: int = 3
  min_shard_elements: int = 1024
  seed: int = 0
  remat: str = "full"

  def __post_init__(self):
    if isinstance(self.stage, bool) or self.stage not in _STAGES:
      raise ValueError(
          f"ZeroConfig.stage must be one of {_STAGES}, got {self.stage!r}. "
          "Use 0 for plain data parallelism, 1 to shard optimizer state, 2 to "
          "also shard gradients, 3 to also shard parameters.")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"ZeroConfig.remat must be one of "
                       f"{sorted(REMAT_POLICIES)}, got {self.remat!r}")
    if self.min_shard_elements < 0:
      raise ValueError(
          f"ZeroConfig.min_shard_elements must be >= 0, got "
          f"{self.min_shard_elements}; use 0 to shard every leaf that has a "
          "dimension divisible by the number of devices.")

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "ZeroConfig":
    """Builds a config from a mapping, rejecting keys it does not know.

    Args:
      d: field names to values.

    Returns:
      The config.

    Raises:
      ValueError: a key is not a field of ``ZeroConfig``; the message lists
        the valid fields.
    """
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
      raise ValueError(
          f"unknown ZeroConfig key(s) {unknown}; valid keys are "
          f"{sorted(fields)}")
    return cls(**d)
