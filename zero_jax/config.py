"""ZeRO configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from zero_jax.layers import REMAT_POLICIES, remat_policy

_STAGES = (0, 1, 2, 3)
_COMPUTE_DTYPES = ("bfloat16", "float16", "float32")


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
      ``zero_jax.scan_layers`` (see ``REMAT_POLICIES``): ``"full"`` (save
      nothing, recompute the layer and re-gather its parameters in backward;
      the default), ``"none"`` (keep everything, including stage 3's gathered
      parameters), ``"dots_saveable"`` (keep matmul outputs, not gathered
      parameters), ``"save_only_named"`` (keep the activations tagged with
      ``zero_jax.checkpoint_name`` for a name in ``remat_names``) or
      ``"offload_to_host"`` (move those to host memory until backward).
    remat_names: the ``checkpoint_name`` tags the named policies act on.
    compute_dtype: dtype of forward/backward and of the communicated
      parameters (``"bfloat16"``, ``"float16"``; None: float32 throughout).
      Master parameters and optimizer state stay float32; at stages 1-2 a
      replicated compute-dtype copy of the parameters is kept for forward
      and refreshed by an all-gather in the compute dtype after each update.
    reduce_dtype: dtype gradients are summed in across devices. None (the
      default) sums in float32 whatever the compute dtype: exact sums cost
      twice the reduce-scatter bytes of bf16; set ``"bfloat16"`` to halve
      them.
  """

  stage: int = 3
  min_shard_elements: int = 1024
  seed: int = 0
  remat: str = "full"
  remat_names: tuple[str, ...] = ()
  compute_dtype: str | None = None
  reduce_dtype: str | None = None

  def __post_init__(self):
    if isinstance(self.stage, bool) or self.stage not in _STAGES:
      raise ValueError(
          f"ZeroConfig.stage must be one of {_STAGES}, got {self.stage!r}. "
          "Use 0 for plain data parallelism, 1 to shard optimizer state, 2 to "
          "also shard gradients, 3 to also shard parameters.")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"ZeroConfig.remat must be one of "
                       f"{sorted(REMAT_POLICIES)}, got {self.remat!r}")
    if isinstance(self.remat_names, str):
      raise ValueError("ZeroConfig.remat_names must be a tuple of names, got "
                       f"the string {self.remat_names!r}; write "
                       f"({self.remat_names!r},)")
    object.__setattr__(self, "remat_names", tuple(self.remat_names))
    remat_policy(self.remat, self.remat_names)  # named policies need names
    for name in ("compute_dtype", "reduce_dtype"):
      value = getattr(self, name)
      if value is None:
        continue
      try:
        canonical = jnp.dtype(value).name
      except TypeError:
        canonical = None
      if canonical not in _COMPUTE_DTYPES:
        raise ValueError(f"ZeroConfig.{name} must be None or one of "
                         f"{_COMPUTE_DTYPES}, got {value!r}")
      object.__setattr__(self, name, canonical)
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
