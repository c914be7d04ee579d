"""A parameter made whole by the compiler, for a loss of global meaning.

With ``ZeroConfig.loss_scope="global"`` the step has no ``shard_map`` over
the batch: ``loss_fn`` runs as plain ``jax.jit`` code on global arrays, and
every collective is the compiler's (GSPMD's). Where the engine still
decides where a parameter is gathered (``scan_layers`` gathering each
layer one layer ahead, or one layer at a time from host memory), it says
so with sharding constraints: the layer's slice constrained to its layout
over ``model`` alone (whole over ``data``: the compiler all-gathers it),
and, by a custom transpose, the slice's gradient constrained to the
slice's own layout (the compiler reduce-scatters it). The plain transpose
of a constraint would constrain the gradient to the whole layout: an
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _made(plan: LeafPlan, mesh: Mesh, whole: bool, compute_dtype: Any,
          reduce_dtype: Any, to_host: bool, shard: jax.Array,
          source: jax.Array | None) -> jax.Array:
  return _made_fwd(plan, mesh, whole, compute_dtype, reduce_dtype, to_host,
                   shard, source)[0]


def _made_fwd(plan, mesh, whole, compute_dtype, reduce_dtype, to_host, shard,
              source):
  del reduce_dtype, to_host
  x = shard if source is None else jax.device_put(source,
                                                  jax.memory.Space.Device)
  x = x.astype(compute_dtype or x.dtype)
  # (A zero-size residual: the dtype the gradient is returned in.)
  like = jnp.zeros((0,), shard.dtype)
  if not whole:
    return _constrain(x, mesh, plan.global_spec), like
  split, gathered = _block_specs(plan)
  b = _constrain(_blocks(x, plan.dim, mesh.shape[DATA]), mesh, split)
  return _joined(_constrain(b, mesh, gathered), plan.dim), like


def _made_bwd(plan, mesh, whole, compute_dtype, reduce_dtype, to_host, like,
              g):
  del whole, compute_dtype
  split, _ = _block_specs(plan)
  b = _blocks(g.astype(reduce_dtype or g.dtype), plan.dim, mesh.shape[DATA])
  b = _constrain(b, mesh, split)
  grad = _constrain(_joined(b, plan.dim), mesh, plan.global_spec)
  grad = grad.astype(like.dtype)
  if to_host:
    # (ZeRO-Offload: the gradient shard leaves the device as soon as
    # backward has made it.)
    grad = jax.device_put(grad, jax.memory.Space.Host)
  # (The source gets no gradient: None, a symbolic zero, which also suits
  # a source in host memory.)
  return grad, None


_made.defvjp(_made_fwd, _made_bwd)


def gather_constrained(plan: LeafPlan, mesh: Mesh, shard: jax.Array,
                       source: jax.Array | None = None,
                       compute_dtype: Any = None, reduce_dtype: Any = None,
                       *, whole: bool = True, to_host: bool = False
                       ) -> jax.Array:
  """A global array laid out as ``plan`` (split over ``data`` alone along
  its dimension), in ``compute_dtype``: whole over ``data``, or with
  ``whole=False`` kept in ``plan``'s layout; its gradient summed into
  that layout in ``reduce_dtype`` and returned in ``shard``'s dtype.

  Args:
    plan: the leaf's (or one layer slice's) layout.
    mesh: the mesh it is laid out on.
    shard: what is differentiated: the array itself, or (with ``source``)
      a zero-valued stand-in of its shape that takes its gradient.
    source: None, or what is read: the array in host memory, copied to
      the device first (one layer at a time inside a scan).
    compute_dtype: the dtype it is used in (None: as stored).
    reduce_dtype: the dtype its gradient is summed in (None: the compute
      dtype; a 16-bit cast of the master is summed in 16 bits, not widened
      first).
    whole: gathered over ``data`` (False: cast and pinned where it is).
    to_host: the gradient goes to host memory (``shard`` a stand-in
      there).
  """
  return _made(plan, mesh, whole,
               compute_dtype and jnp.dtype(compute_dtype),
               reduce_dtype and jnp.dtype(reduce_dtype), to_host, shard,
               source)
