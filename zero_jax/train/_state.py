"""The train state: what persists between steps, and where it lives."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from zero_jax.train import _loss_scale as _ls


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  """Everything that persists between steps; every leaf has a fixed layout.

  Attributes:
    step: number of steps taken (int32 scalar, replicated).
    params: fp32 master parameters, in the structure given to
      ``Engine.init``. Stage 0: replicated. Stage 3: sharded. Stages 1-2 with
      fp32 compute: replicated, because the replicated compute copy *is* the
      master copy; the update slices each device's shard out of it, so no
      second (sharded) copy is stored. Stages 1-2 with a ``compute_dtype``:
      sharded.
    opt_state: optimizer state, every leaf laid out by its shape (sharded at
      stages 1-3, replicated at stage 0).
    rng: base PRNG key (replicated); step keys are derived from it.
    compute_params: the compute-dtype copy of ``params`` that forward
      reads, where it is a separate copy (else None): at stages 1-2 with a
      ``compute_dtype``, replicated and refreshed by an all-gather after
      every update; at stage 3 with a ``compute_dtype`` and
      ``offload_optimizer``, sharded like ``params`` (which are then in host
      memory) and refreshed by a cast.
    loss_scale: the ``LossScaleState``: with float16 compute, the loss
      scale and its counters; in fp32 and bf16 with ``skip_nonfinite`` (the
      default), only its ``skipped`` count changes (the scale stays 1);
      None with neither.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array
  compute_params: Any = None
  loss_scale: _ls.LossScaleState | None = None


def on_host(shardings: Any) -> Any:
  """The same shardings in pinned host memory."""
  return jax.tree.map(lambda sh: sh.with_memory_kind("pinned_host"),
                      shardings)


def on_device(shardings: Any) -> Any:
  """The same shardings in device memory (named, so that a transfer from
  the host is explicit)."""
  return jax.tree.map(lambda sh: sh.with_memory_kind("device"), shardings)


def device_part(state: TrainState) -> TrainState:
  """What the device's program reads with update_on="host"."""
  return dataclasses.replace(state, params=None, opt_state=None)


def compute_copy(placement, master: Any) -> Any:
  """The compute-dtype copy forward reads, where it is a separate copy
  (``placement.compute_copy``), cast from the master; else None."""
  if not placement.compute_copy:
    return None
  return jax.tree.map(lambda x: x.astype(placement.copy_dtype), master)
