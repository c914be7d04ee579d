"""Per-leaf collectives over the ``data`` axis, used inside ``shard_map``.

Every function here takes a ``LeafPlan`` (or a tree of them) and does the
right thing for a sharded leaf (gather / reduce-scatter along its split
dimension) and for a replicated one (nothing / all-reduce).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zero_jax.mesh import DATA
from zero_jax.plan import LeafPlan


def _is_plan(x) -> bool:
  return isinstance(x, LeafPlan)


def gather_leaf(lp: LeafPlan, x: jax.Array) -> jax.Array:
  """All-gathers a sharded leaf into its full value; a replicated leaf is
  only marked device-varying. Under autodiff the gather's transpose is a
  reduce-scatter and the mark's transpose an all-reduce, so gradients come
  back reduced in the leaf's own layout."""
  if lp.sharded:
    return jax.lax.all_gather(x, DATA, axis=lp.dim, tiled=True)
  return jax.lax.pcast(x, DATA, to="varying")


def reduce_leaf(lp: LeafPlan, g: jax.Array) -> jax.Array:
  """Sums a local full gradient over devices into the leaf's layout:
  reduce-scatter along the split dimension, or all-reduce if replicated."""
  if lp.sharded:
    return jax.lax.psum_scatter(g, DATA, scatter_dimension=lp.dim, tiled=True)
  return jax.lax.psum(g, DATA)


def gather_tree(plans, tree):
  return jax.tree.map(gather_leaf, plans, tree, is_leaf=_is_plan)


def reduce_tree(plans, tree):
  return jax.tree.map(reduce_leaf, plans, tree, is_leaf=_is_plan)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scatter_on_backward(dim: int, shard: jax.Array, full: jax.Array):
  del shard
  return full


def _scatter_fwd(dim, shard, full):
  del dim, shard
  return full, None


def _scatter_bwd(dim, _, g):
  # The cotangent of the full copy is reduce-scattered right where backward
  # produces it and becomes the cotangent of the shard; the full copy itself
  # gets none (it is not what we differentiate with respect to).
  return jax.lax.psum_scatter(g, DATA, scatter_dimension=dim,
                              tiled=True), jnp.zeros_like(g)


_scatter_on_backward.defvjp(_scatter_fwd, _scatter_bwd)


def use_with_scattered_grad(lp: LeafPlan, shard: jax.Array,
                            full: jax.Array) -> jax.Array:
  """Returns ``full`` (a device-varying replicated copy) such that the
  gradient with respect to ``shard`` is the reduce-scattered gradient of
  ``full``, computed as soon as backward reaches this use (ZeRO-2)."""
  return _scatter_on_backward(lp.dim, shard, full)
