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

At stage 2 the replicated copy is read as it is, and only its gradient
is constrained into the shard (``use_constrained``).

ZeRO++ follows with the same constraints: qwZ's int8 blocks are made on
each device's own shard and gathered as such, and hpZ's layer is gathered
over ``replica`` into the group's secondary copy (kept for backward), then
over ``data``, its gradient summed over ``data`` and then over
``replica``. qgZ has no form here: it quantizes each device's own
gradient before the sum, and the compiler's sums never hold one.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zero_jax.layout import DATA, LeafPlan
from zero_jax.layout._placement import Quantize
from zero_jax.materialize._collectives import (dequantize_blocks,
                                               quantize_blocks)
from zero_jax.materialize._hierarchical import SECONDARY


def _devices(plan: LeafPlan, mesh: Mesh) -> int:
  """Devices the leaf's dimension is split over (one block each)."""
  return math.prod(mesh.shape[a] for a in plan.axes)


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


def _block_spec(plan: LeafPlan, lead: Any) -> P:
  """The blocks' spec: ``lead`` on the leading block dimension, and
  ``model`` where the leaf has it."""
  return P(lead, *(list(plan.model_spec) or [None] * len(plan.shape)))


def _split(plan: LeafPlan) -> P:
  """The blocks as the shards hold them: block ``i`` on device ``i`` of
  the leaf's axes (with hpZ, ``data`` major: device ``(d, r)`` holds
  block ``d * R + r``)."""
  return _block_spec(plan, plan.axes if plan.hierarchical else DATA)


def _secondary(plan: LeafPlan) -> P:
  """hpZ's secondary partition: the blocks split over ``data`` alone, so
  device ``j`` of each group holds the group's ``j``-th run of ``R``
  blocks (gathered over ``replica``)."""
  return _block_spec(plan, DATA)


def _whole(plan: LeafPlan) -> P:
  return _block_spec(plan, None)


def _constrain(x: jax.Array, mesh: Mesh, spec: P) -> jax.Array:
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def _to_shard(plan: LeafPlan, mesh: Mesh, reduce_dtype: Any, like: jax.Array,
              to_host: bool, g: jax.Array, by_group: bool = False
              ) -> jax.Array:
  """A whole gradient summed into the shard's layout, in ``reduce_dtype``,
  returned in ``like``'s dtype (and host memory). ``by_group`` (hpZ):
  summed over ``data`` first, then over ``replica``, so that only a
  group's block crosses the groups."""
  g = g.astype(reduce_dtype or g.dtype)
  if by_group:
    # (In the leaf's own layout, not as blocks: so constrained, the
    # compiler reduce-scatters inside the group and then across groups;
    # as blocks it all-reduces across groups.)
    entries = [None] * len(plan.shape)
    entries[plan.dim] = DATA
    grad = _constrain(_constrain(g, mesh, P(*entries)), mesh,
                      plan.global_spec)
  else:
    b = _blocks(g, plan.dim, _devices(plan, mesh))
    if plan.hierarchical:
      # (Summed first in the mesh's own device order, ``replica`` major,
      # then permuted into hpZ's: in hpZ's order the compiler all-reduces
      # a scatter's gradient (an embedding's) rather than reduce-scatter
      # it.)
      b = _constrain(b, mesh, _block_spec(plan, tuple(reversed(plan.axes))))
    b = _constrain(b, mesh, _split(plan))
    grad = _constrain(_joined(b, plan.dim), mesh, plan.global_spec)
  grad = grad.astype(like.dtype)
  if to_host:
    # (ZeRO-Offload: the gradient shard leaves the device as soon as
    # backward has made it.)
    grad = jax.device_put(grad, jax.memory.Space.Host)
  return grad


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _made(plan: LeafPlan, mesh: Mesh, whole: bool, compute_dtype: Any,
          reduce_dtype: Any, to_host: bool, shard: jax.Array,
          source: jax.Array | None) -> jax.Array:
  return _made_fwd(plan, mesh, whole, compute_dtype, reduce_dtype, to_host,
                   shard, source)[0]


def _made_fwd(plan, mesh, whole, compute_dtype, reduce_dtype, to_host, shard,
              source):
  del reduce_dtype, to_host
  x = _on_device(shard, source).astype(compute_dtype or shard.dtype)
  # (A zero-size residual: the dtype the gradient is returned in.)
  like = jnp.zeros((0,), shard.dtype)
  if not whole:
    return _constrain(x, mesh, plan.global_spec), like
  b = _constrain(_blocks(x, plan.dim, _devices(plan, mesh)), mesh,
                 _split(plan))
  return _joined(_constrain(b, mesh, _whole(plan)), plan.dim), like


def _made_bwd(plan, mesh, whole, compute_dtype, reduce_dtype, to_host, like,
              g):
  del whole, compute_dtype
  # (The source gets no gradient: None, a symbolic zero, which also suits
  # a source in host memory.)
  return _to_shard(plan, mesh, reduce_dtype, like, to_host, g), None


_made.defvjp(_made_fwd, _made_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _used(plan: LeafPlan, mesh: Mesh, reduce_dtype: Any, stand_in: jax.Array,
          full: jax.Array) -> jax.Array:
  del plan, mesh, reduce_dtype, stand_in
  return full


def _used_fwd(plan, mesh, reduce_dtype, stand_in, full):
  return full, jnp.zeros((0,), stand_in.dtype)


def _used_bwd(plan, mesh, reduce_dtype, like, g):
  # (The copy gets no gradient: the stand-in takes it, as a shard.)
  return _to_shard(plan, mesh, reduce_dtype, like, False, g), None


_used.defvjp(_used_fwd, _used_bwd)


def use_constrained(plan: LeafPlan, mesh: Mesh, stand_in: jax.Array,
                    full: jax.Array, compute_dtype: Any = None,
                    reduce_dtype: Any = None) -> jax.Array:
  """``full`` (stage 2's replicated copy of a leaf, or of one layer slice
  of it) in ``compute_dtype``, whose gradient the compiler reduce-scatters
  into ``plan``'s layout in ``reduce_dtype`` and hands to ``stand_in`` (a
  zero-valued array of the gradient's layout and dtype): a block's or
  scanned layer's gradient is summed into its shard where backward makes
  it, as ``use_with_scattered_grad`` does inside ``shard_map``."""
  reduce_dtype = reduce_dtype and jnp.dtype(reduce_dtype)
  return _used(plan, mesh, reduce_dtype, stand_in,
               full.astype(compute_dtype or full.dtype))


def _on_device(shard: jax.Array, source: jax.Array | None) -> jax.Array:
  """What is read: the shard, or the source copied to the device."""
  if source is None:
    return shard
  return jax.device_put(source, jax.memory.Space.Device)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5, 6))
def _from_read(plan: LeafPlan, mesh: Mesh, dtype: Any, reduce_dtype: Any,
               to_host: bool, quantized: bool, by_group: bool,
               shard: jax.Array, *read: jax.Array) -> jax.Array:
  """The whole value from ``read``: the blocks in the compute dtype, or
  int8 blocks and their scales (qwZ), laid out as the shards or (hpZ) as
  the secondary copy."""
  del reduce_dtype, to_host, quantized, by_group, shard
  if plan.hierarchical:
    # (Pinned where it is read, as where it is made: the compiler would
    # otherwise gather it before remat saves it, and save it whole.)
    read = _secondaries(plan, mesh, read)
  whole = [_constrain(r, mesh, _whole(plan) if i == 0 else P())
           for i, r in enumerate(read)]
  b = whole[0] if len(whole) == 1 else dequantize_blocks(*whole, dtype)
  return _joined(b, plan.dim)


def _from_read_fwd(plan, mesh, dtype, reduce_dtype, to_host, quantized,
                   by_group, shard, *read):
  out = _from_read(plan, mesh, dtype, reduce_dtype, to_host, quantized,
                   by_group, shard, *read)
  return out, jnp.zeros((0,), shard.dtype)


def _from_read_bwd(plan, mesh, dtype, reduce_dtype, to_host, quantized,
                   by_group, like, g):
  del dtype
  # (What was read gets no gradient: the shard it was made from does.)
  return (_to_shard(plan, mesh, reduce_dtype, like, to_host, g,
                    by_group and plan.hierarchical),) + (
                        None,) * (2 if quantized else 1)


_from_read.defvjp(_from_read_fwd, _from_read_bwd)


def _read(plan: LeafPlan, mesh: Mesh, x: jax.Array, dtype: Any,
          quantize: Quantize) -> tuple[jax.Array, ...]:
  """What ``_from_read`` gathers, made from ``x`` (float32 shards): its
  blocks in ``dtype`` or (qwZ) int8 blocks and their float32 scales, each
  device's own shard quantized as the per-device step quantizes it; with
  hpZ gathered over ``replica`` into the secondary copy, named
  ``SECONDARY`` so that remat keeps it for backward."""
  b = _constrain(_blocks(jax.lax.stop_gradient(x), plan.dim,
                         _devices(plan, mesh)), mesh, _split(plan))
  if quantize.weights:
    # (Pinned as quantized, each device its own shard's blocks: the
    # compiler would otherwise gather the float32 shards and quantize
    # after.)
    q, scale = quantize_blocks(b, quantize.block)
    read = (_constrain(q, mesh, _split(plan)),
            _constrain(scale, mesh, P(_split(plan)[0])))
  else:
    read = (b.astype(dtype),)
  if not plan.hierarchical:
    return read
  return tuple(checkpoint_name(r, SECONDARY)
               for r in _secondaries(plan, mesh, read))


def _secondaries(plan: LeafPlan, mesh: Mesh,
                 read: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
  """``read`` (blocks, or int8 blocks and scales) in hpZ's secondary
  layout."""
  return tuple(_constrain(r, mesh, _secondary(plan) if i == 0 else P(DATA))
               for i, r in enumerate(read))


def gather_constrained(plan: LeafPlan, mesh: Mesh, shard: jax.Array,
                       source: jax.Array | None = None,
                       compute_dtype: Any = None, reduce_dtype: Any = None,
                       *, whole: bool = True, to_host: bool = False,
                       quantize: Quantize = Quantize(),
                       by_group: bool = True) -> jax.Array:
  """A global array laid out as ``plan``, in ``compute_dtype``: whole over
  the batch axes, or with ``whole=False`` kept in ``plan``'s layout; its
  gradient summed into that layout in ``reduce_dtype`` and returned in
  ``shard``'s dtype.

  With hpZ (``plan.hierarchical``) it is gathered in two steps, as
  ``gather_hierarchical`` does: over ``replica`` into the group's
  secondary copy (named ``SECONDARY``, which remat keeps), then over
  ``data`` from it, so that backward's recomputation gathers inside the
  group alone; its gradient is summed over ``data``, then over
  ``replica``. With qwZ (``quantize.weights``) what crosses is int8
  blocks and their scales, dequantized to ``compute_dtype``.

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
    whole: gathered over the batch axes (False: cast and pinned where it
      is, which hpZ and qwZ, gathering their own way, refuse).
    to_host: the gradient goes to host memory (``shard`` a stand-in
      there).
    quantize: ZeRO++'s quantized gathers (``weights``); quantized
      gradient sums have no form here (the compiler sums gradients).
    by_group: with hpZ, the gradient summed over each group, then across
      groups (a layer's, whose gradients its gemms make). False: in one
      reduce-scatter over every device, which is what the compiler makes
      of an embedding's (a scatter's) gradient; summed by groups it would
      all-reduce it.

  Raises:
    ValueError: ``whole=False`` with hpZ or qwZ, or ``quantize.gradients``.
  """
  compute_dtype = compute_dtype and jnp.dtype(compute_dtype)
  reduce_dtype = reduce_dtype and jnp.dtype(reduce_dtype)
  if quantize.gradients:
    raise ValueError(
        "qgZ quantizes each device's own gradient before the sum, which a "
        "loss of global meaning leaves to the compiler: use "
        "loss_scope='per_device' with quantized_gradients.")
  if quantize.weights and not whole:
    raise ValueError("qwZ gathers a parameter as int8 blocks: call "
                     "gather_constrained with whole=True.")
  if not (whole and (plan.hierarchical or quantize.weights)):
    return _made(plan, mesh, whole, compute_dtype, reduce_dtype, to_host,
                 shard, source)
  x = _on_device(shard, source)
  return _from_read(plan, mesh, compute_dtype or x.dtype, reduce_dtype,
                    to_host, quantize.weights, by_group, shard,
                    *_read(plan, mesh, x, compute_dtype or x.dtype, quantize))
