"""A parameter made whole by the compiler, for a loss of global meaning.

With ``ZeroConfig.loss_scope="global"`` the step has no ``shard_map`` over
the batch: ``loss_fn`` runs as plain ``jax.jit`` code on global arrays, and
every collective is the compiler's (GSPMD's). A layer scan that gathers
one layer ahead (``zero_jax.layers``' prefetch) still has to say where each
layer is gathered and where its gradient is summed. It says so with
sharding constraints: the layer's slice constrained to its layout over
``model`` alone (whole over ``data``: the compiler all-gathers it), and,
by a custom transpose, the slice's gradient constrained to the slice's
own layout (the compiler reduce-scatters it). The plain transpose of a
constraint would constrain the gradient to the whole layout: an
all-reduce of every layer's gradient.

As ``major_gather`` does inside ``shard_map``, the split dimension is cut
into one block per device and the blocks stacked along a new leading
dimension, which the collectives run along: GPU collectives concatenate
along the most major dimension, and asked for another, XLA transposes the
whole stack of float32 shards once before the layer loop.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zero_jax.layout import DATA, LeafPlan


def _blocks(x: jax.Array, dim: int, n: int) -> jax.Array:
  """``x`` with ``dim`` cut into ``n`` blocks stacked along a new leading
  dimension."""
  s = x.shape
  return jnp.moveaxis(x.reshape(s[:dim] + (n, s[dim] // n) + s[dim + 1:]),
                      dim, 0)


def _joined(b: jax.Array, dim: int) -> jax.Array:
  """``_blocks``' inverse."""
  y = jnp.moveaxis(b, 0, dim)
  return y.reshape(y.shape[:dim] + (-1,) + y.shape[dim + 2:])


def _block_specs(plan: LeafPlan) -> tuple[P, P]:
  """The blocks' specs: split over ``data`` along the new leading
  dimension, and whole; ``model`` where the leaf has it."""
  entries = list(plan.model_spec) or [None] * len(plan.shape)
  return P(DATA, *entries), P(None, *entries)


def _constrain(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _gather(plan: LeafPlan, mesh: Mesh, whole: bool, reduce_dtype: Any,
            x: jax.Array) -> jax.Array:
  return _gather_fwd(plan, mesh, whole, reduce_dtype, x)[0]


def _gather_fwd(plan, mesh, whole, reduce_dtype, x):
  del reduce_dtype
  if not whole:
    return _constrain(x, mesh, plan.global_spec), None
  split, gathered = _block_specs(plan)
  b = _constrain(_blocks(x, plan.dim, mesh.shape[DATA]), mesh, split)
  return _joined(_constrain(b, mesh, gathered), plan.dim), None


def _gather_bwd(plan, mesh, whole, reduce_dtype, _, g):
  del whole
  split, _ = _block_specs(plan)
  b = _blocks(g.astype(reduce_dtype or g.dtype), plan.dim, mesh.shape[DATA])
  b = _constrain(b, mesh, split)
  return (_constrain(_joined(b, plan.dim), mesh, plan.global_spec)
          .astype(g.dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def gather_constrained(plan: LeafPlan, mesh: Mesh, x: jax.Array,
                       reduce_dtype: Any = None) -> jax.Array:
  """``x`` (a global array laid out as ``plan``, split over ``data`` alone
  along its dimension) whole over ``data``, its gradient reduce-scattered
  back into ``plan``'s layout.

  Args:
    plan: the leaf's (or one layer slice's) layout.
    mesh: the mesh it is laid out on.
    x: the array.
    reduce_dtype: the dtype the gradient is summed in (None: its own).
  """
  return _gather(plan, mesh, True, reduce_dtype and jnp.dtype(reduce_dtype),
                 x)


def pin_constrained(plan: LeafPlan, mesh: Mesh, x: jax.Array,
                    reduce_dtype: Any = None) -> jax.Array:
  """``x`` kept in ``plan``'s layout, its gradient summed into that layout
  in ``reduce_dtype`` (None: ``x``'s; a 16-bit cast of the master pinned
  so is summed in 16 bits, not widened first)."""
  return _gather(plan, mesh, False, reduce_dtype and jnp.dtype(reduce_dtype),
                 x)
