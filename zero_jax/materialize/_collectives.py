"""Per-leaf collectives over the ``data`` axis, used inside ``shard_map``.

Every function here takes a ``LeafPlan`` (or a tree of them) and does the
right thing for a sharded leaf (gather / reduce-scatter along its split
dimension) and for a replicated one (nothing / all-reduce). On a 2-D
``(replica, data)`` mesh, gradients are reduce-scattered inside the group and
then the *shards* are all-reduced across groups (the cheap order: Ψ/N
elements cross the slow links, not Ψ).

With a ``model`` axis (tensor parallelism) the step is manual over the batch
axes only and automatic over ``model``. A collective over ``data`` there
would see each operand whole over ``model``: XLA's partitioner all-gathers a
model-split parameter over ``model`` before gathering it over ``data``
(measured: M times the bytes, and the whole layer on every device). So each
collective on a model-split leaf runs in a region manual over ``model`` too
(``_region``): every model rank gathers and reduce-scatters only its own
slice, and the result leaves the region split over ``model`` again.

Mixed precision: ``compute_dtype`` is the dtype parameters are gathered and
used in (half the bytes of fp32 for bf16/fp16); ``reduce_dtype`` the dtype
gradients are summed in. ``None`` keeps the array's own dtype.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zero_jax._compat import varying_axes
from zero_jax.layout import DATA, MODEL, LeafPlan
from zero_jax.layout._mesh import batch_axes, replica_axes
from zero_jax.layout._placement import Quantize
from zero_jax.layout._plan import map_leaves


def cast(x: jax.Array, dtype) -> jax.Array:
  """``x`` in ``dtype``; None keeps its own."""
  return x if dtype is None else x.astype(dtype)


def _all_axes() -> tuple[str, ...]:
  return batch_axes(jax.sharding.get_abstract_mesh())


def _to_replica_varying(x: jax.Array) -> jax.Array:
  # Marking the shard varying over ``replica`` *before* the gather makes the
  # transpose all-reduce the reduce-scattered shard across groups, not the
  # full gradient. (Already varying there when a block's barrier joined it
  # to the activation: zero_jax.layers.layer.)
  vma = varying_axes(x)
  axes = tuple(a for a in replica_axes() if a not in vma)
  return jax.lax.pcast(x, axes, to="varying") if axes else x


def like_of(x: jax.Array) -> jax.Array:
  """A zero-size residual with ``x``'s dtype and varying axes (never its
  data, nor its memory space)."""
  z = jnp.zeros((0,), x.dtype)
  axes = tuple(sorted(varying_axes(x)))
  return jax.lax.pcast(z, axes, to="varying") if axes else z


def _region(lp: LeafPlan, fn, *xs: jax.Array, in_spec: P | None = None,
            out_spec: P | None = None, summed: tuple[str, ...] = ()):
  """``fn(*xs)`` on each model rank's own slice of a model-split leaf (a
  region manual over ``model``; see the module docstring); plain ``fn``
  otherwise. The specs default to the leaf's ``model_spec``; ``summed``:
  the batch axes ``fn`` sums over (its result is the same across them)."""
  if not lp.model_split:
    return fn(*xs)
  spec = lp.model_spec
  in_spec = spec if in_spec is None else in_spec
  out_spec = spec if out_spec is None else out_spec
  out = jax.shard_map(fn, in_specs=(in_spec,) * len(xs), out_specs=out_spec,
                      axis_names={MODEL}, check_vma=not lp.both)(*xs)
  if lp.both:
    # A leaf split over both axes leaves (or enters) the region whole over
    # ``model`` along its data dimension, which the type checker cannot
    # follow (``_gather_data``): the result varies over the batch axes as
    # its operand does.
    axes = tuple(sorted(varying_axes(xs[0]) - {MODEL, *summed}))
    if axes:
      out = jax.lax.pcast(out, axes, to="varying")
  return out


def _whole_model_spec(lp: LeafPlan) -> P:
  """The model spec of a leaf split over both axes once its data dimension
  is whole (that dimension then whole over ``model`` too)."""
  return P(*[None if d == lp.dim else e
             for d, e in enumerate(lp.model_spec)])


def major_gather(x: jax.Array, dim: int, axis: str = DATA) -> jax.Array:
  """All-gather over ``axis`` along ``dim``, the shards stacked along a new
  leading dimension first.

  GPU all-gathers concatenate along the most major dimension. Asked for
  another, XLA gives the operand a layout where ``dim`` is major, and for a
  scanned layer's slice it does so once, for the whole stack before the loop:
  a transposed copy of every layer's float32 shards (2.7 GiB a device at 6.7B
  on 8 H100s). Stacked along a new dimension, the shards need no layout of
  their own; what is moved is the gathered 16-bit layer, one at a time.
  """
  if dim == 0:
    return jax.lax.all_gather(x, axis, axis=0, tiled=True)
  return _unstack(jax.lax.all_gather(x, axis, axis=0), dim)


def _unstack(stacked: jax.Array, dim: int) -> jax.Array:
  """Shards stacked along a new leading dimension, joined along ``dim``."""
  y = jnp.moveaxis(stacked, 0, dim)
  return y.reshape(y.shape[:dim] + (-1,) + y.shape[dim + 2:])


def blocks_major(g: jax.Array, dim: int, axis: str = DATA) -> jax.Array:
  """``g`` with ``dim`` cut into one block per ``axis`` device, the blocks
  stacked along a new leading dimension (see ``major_gather``)."""
  n = jax.lax.axis_size(axis)
  shape = g.shape
  g = g.reshape(shape[:dim] + (n, shape[dim] // n) + shape[dim + 1:])
  return jnp.moveaxis(g, dim, 0)


def quantize_blocks(x: jax.Array, block: int
                    ) -> tuple[jax.Array, jax.Array]:
  """``x`` as int8 blocks along its last dimension and their float32 scales
  (``Quantize``): ``x ~= q * scale`` per block.

  Args:
    x: a floating array of at least one dimension.
    block: elements per block (the whole last dimension where it does not
      divide it).

  Returns:
    ``(q, scale)``: ``q`` int8 of ``x``'s shape, ``scale`` float32 of
    ``x.shape[:-1] + (blocks,)``. A block holding inf or nan gets an inf or
    nan scale, so dequantizing it gives a non-finite value again (the step
    sees it and is skipped).
  """
  k = x.shape[-1]
  b = block if k % block == 0 else k
  xb = x.astype(jnp.float32).reshape(x.shape[:-1] + (k // b, b))
  scale = jnp.max(jnp.abs(xb), axis=-1) / 127
  safe = jnp.where(scale == 0, 1.0, scale)
  q = jnp.clip(jnp.round(xb / safe[..., None]), -127, 127).astype(jnp.int8)
  return q.reshape(x.shape), scale


def dequantize_blocks(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
  """``quantize_blocks``'s inverse, in ``dtype``."""
  k, blocks = q.shape[-1], scale.shape[-1]
  x = (q.astype(jnp.float32).reshape(q.shape[:-1] + (blocks, k // blocks)) *
       scale[..., None])
  return x.reshape(q.shape).astype(dtype)


def _gather_data(lp: LeafPlan, x: jax.Array, dtype=None,
                 quantize: Quantize | None = None) -> jax.Array:
  """All-gather of a sharded leaf over ``data``, in ``dtype``, as int8
  blocks with ``quantize.weights`` (forward only: the callers' custom
  rules give its transpose, ``_scatter_data``)."""

  def whole(x):
    if not lp.both:
      return major_gather(x, lp.dim)
    # Data major: block (d, m) of the dimension is on device (d, m), so
    # gathering over ``model`` first gives data block d, then over
    # ``data`` the whole dimension.
    return jax.lax.all_gather(
        jax.lax.all_gather(x, MODEL, axis=lp.dim, tiled=True), DATA,
        axis=lp.dim, tiled=True)

  def gather(x):
    # (On each model rank's own slice of a model-split leaf: its blocks
    # and scales are its own.)
    if quantize is None or not quantize.weights:
      return whole(cast(x, dtype))
    q, scale = quantize_blocks(x, quantize.block)
    return dequantize_blocks(whole(q), whole(scale), dtype or x.dtype)

  return _region(lp, gather, x,
                 out_spec=_whole_model_spec(lp) if lp.both else None)


def reduce_blocks(blocks: jax.Array, reduce_dtype,
                  quantize: Quantize | None, axis: str = DATA) -> jax.Array:
  """Sums ``blocks`` (one block per ``axis`` device along the leading
  dimension, ``blocks_major``) over ``axis``: this device's block.

  A reduce-scatter in ``reduce_dtype``, unless that would widen the blocks
  (16-bit gradients, float32 sums: the default) or ``quantize.gradients``
  asks for int8: then an all-to-all hands each device every device's block
  of its own shard, in the gradient's dtype or as int8 blocks, which it
  widens and sums locally. Widened, that is as exact as a float32
  reduce-scatter (the same values summed in float32) for the bytes of a
  16-bit one, and no whole gradient is held in float32: the widening fuses
  into the sum of the received blocks, a shard's worth.
  """
  to_all = lambda x: jax.lax.all_to_all(x, axis, 0, 0, tiled=True)
  if quantize is not None and quantize.gradients:
    q, scale = quantize_blocks(blocks, quantize.block)
    # Block j of every device goes to device j, stacked by its sender.
    return jnp.sum(dequantize_blocks(to_all(q), to_all(scale), jnp.float32),
                   axis=0)
  if (reduce_dtype is not None and
      jnp.dtype(reduce_dtype).itemsize > blocks.dtype.itemsize):
    return jnp.sum(to_all(blocks).astype(reduce_dtype), axis=0)
  return jax.lax.psum_scatter(cast(blocks, reduce_dtype), axis,
                              scatter_dimension=0)


def _scatter_data(lp: LeafPlan, g: jax.Array, reduce_dtype=None,
                  quantize: Quantize | None = None) -> jax.Array:
  """Reduce-scatter of a whole gradient over ``data`` into the leaf's
  shard (``reduce_blocks`` of its blocks; then summed across replica
  groups by the caller)."""
  reduce = lambda g: reduce_blocks(blocks_major(g, lp.dim), reduce_dtype,
                                    quantize)
  if not lp.both:
    return _region(lp, reduce, g)

  def own(g):
    # g is the whole dimension, the same on every model rank: keep this
    # rank's block of each data block, then reduce-scatter over data.
    n, m = jax.lax.axis_size(DATA), jax.lax.axis_size(MODEL)
    shape = g.shape
    k = shape[lp.dim] // (n * m)
    g = g.reshape(shape[:lp.dim] + (n, m, k) + shape[lp.dim + 1:])
    g = jax.lax.dynamic_index_in_dim(g, jax.lax.axis_index(MODEL),
                                     lp.dim + 1, keepdims=False)
    return reduce(g.reshape(shape[:lp.dim] + (n * k,) + shape[lp.dim + 1:]))

  return _region(lp, own, g, in_spec=_whole_model_spec(lp))


def _scatter_grad(lp: LeafPlan, g: jax.Array, reduce_dtype,
                  like: jax.Array, quantize: Quantize | None = None):
  """Reduce-scatter over ``data``, then all-reduce across replica groups,
  in the dtype of ``like`` (``like_of`` the shard). Where the shard itself
  varies across groups (a block's barrier made it so: zero_jax.layers.layer), the
  sum across groups is left to that variation's transpose."""
  return _across_groups(lp, _scatter_data(lp, g, reduce_dtype, quantize),
                        like)


def _across_groups(lp: LeafPlan, g: jax.Array, like: jax.Array) -> jax.Array:
  """``g`` summed across the replica groups ``like`` does not vary over."""
  axes = tuple(a for a in replica_axes() if a not in varying_axes(like))
  if axes:
    g = _region(lp, lambda g: jax.lax.psum(g, axes), g, summed=axes)
  return g.astype(like.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _gather_mixed(lp: LeafPlan, compute_dtype, reduce_dtype,
                  quantize: Quantize, x: jax.Array):
  return _gather_data(lp, _to_replica_varying(x), compute_dtype, quantize)


def _gather_mixed_fwd(lp, compute_dtype, reduce_dtype, quantize, x):
  # Only the dtype of x is needed in backward; a zero-size residual keeps it
  # without saving the shard.
  return (_gather_mixed(lp, compute_dtype, reduce_dtype, quantize, x),
          like_of(x))


def _gather_mixed_bwd(lp, compute_dtype, reduce_dtype, quantize, res, g):
  return (_scatter_grad(lp, g, reduce_dtype, res, quantize),)


_gather_mixed.defvjp(_gather_mixed_fwd, _gather_mixed_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _gather_group(lps: tuple[LeafPlan, ...], compute_dtype, reduce_dtype,
                  *xs: jax.Array) -> list[jax.Array]:
  xs = [cast(_to_replica_varying(x), compute_dtype) for x in xs]
  stacked = jax.lax.all_gather(
      jnp.concatenate([x.reshape(-1) for x in xs]), DATA, axis=0)
  out, start = [], 0
  for lp, x in zip(lps, xs):
    out.append(_unstack(stacked[:, start:start + x.size]
                        .reshape((-1,) + x.shape), lp.dim))
    start += x.size
  return out


def _gather_group_fwd(lps, compute_dtype, reduce_dtype, *xs):
  return (_gather_group(lps, compute_dtype, reduce_dtype, *xs),
          tuple(like_of(x) for x in xs))


def _gather_group_bwd(lps, compute_dtype, reduce_dtype, likes, gs):
  n = jax.lax.axis_size(DATA)
  blocks = [blocks_major(g, lp.dim).reshape(n, -1)
            for lp, g in zip(lps, gs)]
  summed = reduce_blocks(jnp.concatenate(blocks, 1), reduce_dtype, None)
  out, start = [], 0
  for lp, b, g, like in zip(lps, blocks, gs, likes):
    shape = g.shape[:lp.dim] + (g.shape[lp.dim] // n,) + g.shape[lp.dim + 1:]
    out.append(_across_groups(
        lp, summed[start:start + b.shape[1]].reshape(shape), like))
    start += b.shape[1]
  return tuple(out)


_gather_group.defvjp(_gather_group_fwd, _gather_group_bwd)


def gather_leaves(lps: Sequence[LeafPlan], xs: Sequence[jax.Array],
                  compute_dtype=None, reduce_dtype=None) -> list[jax.Array]:
  """``gather_leaf`` of each of ``xs``, in one all-gather.

  The shards, cast to ``compute_dtype``, cross as one buffer; under
  autodiff their gradients come back through one reduction of every leaf's
  blocks side by side: a layer as one collective each way, where XLA
  combines the gathers only in part and the all-to-alls not at all. Each
  leaf must be split over ``data`` alone (not ``lp.model_split``).
  """
  if not xs:
    return []
  for lp in lps:
    if not lp.sharded or lp.model_split:
      raise ValueError(f"gather_leaves: {lp} is not split over data alone")
  return list(_gather_group(tuple(lps), compute_dtype or xs[0].dtype,
                            reduce_dtype, *xs))


def gather_leaf(lp: LeafPlan, x: jax.Array, compute_dtype=None,
                reduce_dtype=None, quantize: Quantize = Quantize()
                ) -> jax.Array:
  """The full value of a leaf from its shard, in ``compute_dtype``.

  A sharded leaf is cast, then all-gathered (so a bf16 gather moves half the
  bytes of fp32; int8 blocks with ``quantize.weights``); a replicated one
  is only marked device-varying and cast. Under autodiff the gradient comes
  back reduced in the leaf's own layout and dtype: reduce-scattered (summed
  in ``reduce_dtype``; see ``reduce_blocks``) for a sharded leaf,
  all-reduced for a replicated one.
  """
  if not lp.sharded:
    # pcast first, cast second: the all-reduce (pcast's transpose) then runs
    # on the fp32 cotangent.
    return cast(_region(lp, lambda x: jax.lax.pcast(x, _all_axes(),
                                                    to="varying"), x),
                compute_dtype)
  if (compute_dtype is None and reduce_dtype is None and not lp.both and
      quantize == Quantize()):
    # Plain autodiff: all_gather's transpose is psum_scatter.
    return _gather_data(lp, _to_replica_varying(x))
  return _gather_mixed(lp, compute_dtype or x.dtype, reduce_dtype, quantize,
                       x)


def reduce_leaf(lp: LeafPlan, g: jax.Array, reduce_dtype=None,
                out_dtype=None, quantize: Quantize = Quantize()
                ) -> jax.Array:
  """Sums a local full gradient over devices into the leaf's layout:
  reduce-scatter along the split dimension (``reduce_blocks``), or
  all-reduce if replicated."""
  out_dtype = out_dtype or g.dtype
  if lp.sharded:
    return _scatter_grad(lp, g, reduce_dtype, jnp.zeros((0,), out_dtype),
                         quantize)
  axes = _all_axes()
  return _region(lp, lambda g: jax.lax.psum(cast(g, reduce_dtype), axes), g,
                 summed=axes).astype(out_dtype)


def psum_leaf(lp: LeafPlan, x: jax.Array, axes: tuple[str, ...]
              ) -> jax.Array:
  """``jax.lax.psum(x, axes)`` over batch axes, on each model rank's own
  slice of a model-split leaf."""
  return _region(lp, lambda x: jax.lax.psum(x, axes), x, summed=axes)


def zeros(lp: LeafPlan, shape: tuple[int, ...], dtype) -> jax.Array:
  """Zeros of ``shape`` (the leaf's shape in the ``shard_map`` view), laid
  out over ``model`` as the leaf is, so no device holds a whole copy."""
  z = jnp.zeros(shape, dtype)
  if lp.model_split:
    z = jax.lax.with_sharding_constraint(z, lp.model_spec)
  return z


def reduce_tree(plans, tree, reduce_dtype=None, out_dtype=None,
                quantize: Quantize = Quantize()):
  """``reduce_leaf`` on every leaf of ``tree`` (``plans``: its plans)."""
  return map_leaves(lambda lp, g: reduce_leaf(lp, g, reduce_dtype, out_dtype,
                                              quantize), plans, tree)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _scatter_on_backward(lp: LeafPlan, reduce_dtype, quantize: Quantize,
                         shard: jax.Array, full: jax.Array):
  del shard
  return full


def _scatter_fwd(lp, reduce_dtype, quantize, shard, full):
  del lp, reduce_dtype, quantize
  return full, like_of(shard)


def _scatter_bwd(lp, reduce_dtype, quantize, res, g):
  # The cotangent of the full copy is reduce-scattered right where backward
  # produces it and becomes the cotangent of the shard; the full copy itself
  # gets none (it is not what we differentiate with respect to).
  return (_scatter_grad(lp, g, reduce_dtype, res, quantize),
          jnp.zeros_like(g))


_scatter_on_backward.defvjp(_scatter_fwd, _scatter_bwd)


def use_with_scattered_grad(lp: LeafPlan, shard: jax.Array,
                            full: jax.Array, reduce_dtype=None,
                            quantize: Quantize = Quantize()) -> jax.Array:
  """Returns ``full`` (a device-varying replicated copy) such that the
  gradient with respect to ``shard`` is the reduce-scattered gradient of
  ``full`` (summed in ``reduce_dtype``, returned in ``shard``'s dtype),
  computed as soon as backward reaches this use (ZeRO-2)."""
  return _scatter_on_backward(lp, reduce_dtype, quantize, shard, full)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _gather_from(lp: LeafPlan, compute_dtype, reduce_dtype,
                 quantize: Quantize, to_device: bool, grad_to_host: bool,
                 stand_in: jax.Array, source: jax.Array):
  del stand_in, grad_to_host
  if to_device:
    source = jax.device_put(source, jax.memory.Space.Device)
  return _gather_data(lp, _to_replica_varying(source), compute_dtype,
                      quantize)


def _gather_from_fwd(lp, compute_dtype, reduce_dtype, quantize, to_device,
                     grad_to_host, stand_in, source):
  out = _gather_from(lp, compute_dtype, reduce_dtype, quantize, to_device,
                     grad_to_host, stand_in, source)
  return out, like_of(stand_in)


def _gather_from_bwd(lp, compute_dtype, reduce_dtype, quantize, to_device,
                     grad_to_host, res, g):
  # The source gets no gradient (None: a symbolic zero, which also suits a
  # source in host memory).
  grad = _scatter_grad(lp, g, reduce_dtype, res, quantize)
  if grad_to_host:
    # ZeRO-Offload: the gradient shard leaves the device as soon as
    # backward has made it.
    grad = jax.device_put(grad, jax.memory.Space.Host)
  return grad, None


_gather_from.defvjp(_gather_from_fwd, _gather_from_bwd)


def gather_from(lp: LeafPlan, stand_in: jax.Array, source: jax.Array,
                compute_dtype=None, reduce_dtype=None,
                to_device: bool = False, grad_to_host: bool = False,
                quantize: Quantize = Quantize()) -> jax.Array:
  """All-gathers the shard ``source`` while sending its gradient to
  ``stand_in``.

  Stage 3 when the shard forward reads is not the fp32 master: a sharded
  compute-dtype copy, or a master shard in host memory (``to_device``
  copies it to the device first, one layer at a time inside a scan). The
  gradient is reduce-scattered in ``reduce_dtype`` and returned in
  ``stand_in``'s dtype (a zero-valued fp32 array of the shard's shape), in
  host memory if ``grad_to_host``.
  """
  return _gather_from(lp, compute_dtype or source.dtype, reduce_dtype,
                      quantize, to_device, grad_to_host, stand_in, source)


def gather_replicated(plan: Any, tree: Any, dtype: Any = None) -> Any:
  """Explicit all-gather of a tree's sharded leaves into replicated copies,
  cast to ``dtype`` first (so a bf16 copy moves half the bytes). Runs its
  own ``shard_map`` over ``plan.mesh`` (``plan``: a ``Plan``): call it on
  global arrays, outside the step's ``shard_map``."""

  def gather(lp, x):
    x = cast(x, dtype)
    return _gather_data(lp, x) if lp.sharded else x

  fn = jax.shard_map(
      lambda t: map_leaves(gather, plan.leaves, t),
      mesh=plan.mesh, in_specs=(plan.specs,),
      out_specs=plan.replicated_specs,
      axis_names=set(batch_axes(plan.mesh)),
      # all_gather's result is typed device-varying, but it is identical on
      # every device by construction.
      check_vma=False)
  return fn(tree)
