"""ZeRO++'s hpZ (arXiv:2306.10209): stage 3's gathers split in two levels,
so that backward's never leave a group of devices (a node).

On a ``(replica, data)`` mesh, an hpZ leaf is split over ``replica`` inside
``data`` (``layout.HIERARCHICAL``): the primary partition, one shard per
device, which the fp32 master, the optimizer state and the gradients keep.
Forward gathers a layer in two steps:

1. over ``replica`` (across groups): device ``j`` of each group gets the
   ``j``-th contiguous block of the parameter, in the compute dtype (int8
   blocks with qwZ), the *secondary* partition, named ``SECONDARY`` so that
   remat keeps it for backward (``zero_jax.layers``);
2. over ``data`` (inside the group): the whole parameter, used and dropped.

Backward's recomputation repeats only step 2, from the kept secondary copy
(1/K of the parameters per device, K = the group's size). Gradients go back
the same two ways: summed over ``data`` into the group's block, then over
``replica`` into the shard, both in ``reduce_dtype`` (float32 sums of
16-bit blocks by an all-to-all by default, exact; int8 blocks at both
levels with qgZ). Across groups only a block's worth crosses each way.
"""

from __future__ import annotations

import functools

import jax
from jax.ad_checkpoint import checkpoint_name

from zero_jax.layout import REPLICA, LeafPlan
from zero_jax.layout._placement import Quantize
from zero_jax.materialize._collectives import (blocks_major, cast,
                                               dequantize_blocks, like_of,
                                               major_gather, quantize_blocks,
                                               reduce_blocks)

# The ``checkpoint_name`` of the secondary partition: what remat keeps.
SECONDARY = "zero_hpz_secondary"


def _secondary(lp: LeafPlan, shard: jax.Array, dtype,
               quantize: Quantize) -> tuple[jax.Array, ...]:
  """The shard gathered across groups: the device's block of the group's
  secondary partition, in ``dtype`` (or int8 blocks and their scales)."""
  across = lambda x: major_gather(x, lp.dim, REPLICA)
  if quantize.weights:
    q, scale = quantize_blocks(shard, quantize.block)
    return across(q), across(scale)
  return (across(cast(shard, dtype)),)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _from_secondary(lp: LeafPlan, dtype, reduce_dtype, quantize: Quantize,
                    shard: jax.Array, *secondary: jax.Array) -> jax.Array:
  del shard, reduce_dtype
  if quantize.weights:
    q, scale = secondary
    return dequantize_blocks(major_gather(q, lp.dim),
                             major_gather(scale, lp.dim), dtype)
  return major_gather(secondary[0], lp.dim)


def _from_secondary_fwd(lp, dtype, reduce_dtype, quantize, shard,
                        *secondary):
  out = _from_secondary(lp, dtype, reduce_dtype, quantize, shard, *secondary)
  return out, like_of(shard)


def _from_secondary_bwd(lp, dtype, reduce_dtype, quantize, like, g):
  # Inside the group first (the whole gradient), then across groups (one
  # group block): the slow links carry 1/K of what a flat sum would.
  group = reduce_blocks(blocks_major(g, lp.dim), reduce_dtype, quantize)
  shard = reduce_blocks(blocks_major(group, lp.dim, REPLICA), reduce_dtype,
                        quantize, REPLICA)
  # The secondary copy gets no gradient: the shard it was made from does.
  return (shard.astype(like.dtype),) + (None,) * (2 if quantize.weights
                                                  else 1)


_from_secondary.defvjp(_from_secondary_fwd, _from_secondary_bwd)


def gather_hierarchical(lp: LeafPlan, shard: jax.Array, compute_dtype=None,
                        reduce_dtype=None, quantize: Quantize = Quantize()
                        ) -> jax.Array:
  """The full value of an hpZ leaf (``lp.hierarchical``) from its shard.

  Args:
    lp: the leaf's (or one layer slice's) plan.
    shard: this device's primary shard.
    compute_dtype: the dtype of the full value and of the secondary copy
      (None: the shard's).
    reduce_dtype: the dtype gradients are summed in, at both levels.
    quantize: qwZ gathers int8 blocks (the secondary copy kept as int8
      blocks too); qgZ sums int8 gradient blocks at both levels.

  Returns:
    The whole parameter, in ``compute_dtype``. Under autodiff the shard's
    gradient is the full gradient summed over every device.
  """
  dtype = compute_dtype or shard.dtype
  secondary = [checkpoint_name(jax.lax.stop_gradient(s), SECONDARY)
               for s in _secondary(lp, shard, dtype, quantize)]
  return _from_secondary(lp, dtype, reduce_dtype, quantize, shard,
                         *secondary)
