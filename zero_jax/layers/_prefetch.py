"""A layer scan whose next layer's gather runs during this layer's compute.

``jax.lax.scan`` with ZeRO-3 gathers inside the body issues layer i's
all-gather at the top of iteration i, where the first matmul waits for it:
nothing overlaps it but the previous layer's tail. Carrying layer i+1's
gathered parameters in the scan's carry would let the gather run during
layer i, but autodiff then saves the carry of every iteration for backward:
the whole gathered model.

``prefetched_scan`` therefore has its own backward (a ``jax.custom_vjp``):
forward gathers layer i+1 while layer i runs and saves only each layer's
input (``remat="full"``); backward walks the layers in reverse, gathers
layer i-1 while layer i is recomputed and differentiated, and hands layer
i's weight gradients to the gather's transpose in the next iteration, while
layer i-1 is differentiated: one reduction per layer, every leaf's blocks
side by side (``materialize_together``), so that a layer's
gradient sum is one collective for XLA's scheduler to hide.

Parameters are gathered leaf by leaf, each into its own buffer, and the
step is compiled with ``COMPILER_OPTIONS``: XLA combines a layer's gathers
into one collective of several buffers, and lets two collectives be in
flight, so a layer's gather and the previous layer's gradient sum overlap
the gemms together. (One concatenated gather per layer, the first design,
moved as well but held each layer twice: the gathered buffer and its
leaves' copies; compiled for 8 H100s, the 1.3B GPT's peak was 6.11 GiB
against 6.03 now.)

At stage 2 (``Materializer.keep``) forward also saves each gathered layer
for backward, which gathers nothing: each leaf's gradient is
reduce-scattered as the layer's backward makes it, as a replicated copy's
is (``_kept_backward``). That replaces stage 2's all-gather after the
update, which has nothing to overlap, with these gathers in forward.

The price is memory: the layer ahead and the gradients carried to the
next iteration, about two layers' 16-bit parameters. Storing each layer's
gradient shard in the 16-bit compute dtype until the update
(``stored_dtype``) pays for it on 8 devices (compiled for 8 H100s, jax
0.10.2: the 1.3B GPT's peak 5.75 GiB against 5.66 without prefetch and
GSPMD's 6.04; 6.7B 15.13 against 15.10 and 15.23), so ``ZeroConfig.prefetch``
is on by default ("auto"). The first and last iterations gather (and
reduce) one layer twice rather than branch.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from zero_jax.layout import Materialize
from zero_jax.materialize._collectives import use_with_scattered_grad
from zero_jax.materialize._materializer import materialize_together

# XLA options the step is compiled with under prefetch (GPU scheduling; no
# effect elsewhere): two collectives in flight, a layer's gather beside the
# previous layer's gradient sum, where XLA's default keeps one; and a
# layer's per-leaf gathers combined into one collective (up to 1 GiB).
COMPILER_OPTIONS = {
    "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
    "xla_gpu_all_gather_combine_threshold_bytes": 1 << 30,
}
# With a loss of global meaning (``Materialize.CONSTRAIN``), also: each
# leaf's gradient reduce-scattered on its own. The compiler sums a layer's
# gradients in the iteration that makes them (a loop cannot carry a sum
# it has not made); left uncombined, each leaf's reduction starts as its
# gradient is made and overlaps the rest of the layer's backward (compiled
# for 8 H100s with jax 0.10.2, 1.3B GPT: 57% of their bytes overlap a
# gemm, against 7% combined;
# experiments/results/stage3_global_prefetch_h100.md).
GLOBAL_COMPILER_OPTIONS = {
    **COMPILER_OPTIONS,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
}


def _index(tree: Any, i: jax.Array) -> Any:
  return jax.tree.map(
      lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def stored_dtype(shard: Any, compute: Any) -> Any:
  """The dtype a scanned layer's gradient shard waits in for the update.

  With a 16-bit compute dtype, each layer's gradient is summed in float32
  on its shard and stored rounded to the compute dtype, as single-device
  mixed-precision training's is (its weight gradients are 16-bit gemm
  results): half the bytes of a float32 stack of every layer's gradient
  shard (1.5 GiB a device for the 6.7B GPT on 8 devices).

  Args:
    shard: the shard's dtype.
    compute: the materializer's compute dtype (None: as stored).
  """
  if (compute is not None and jnp.issubdtype(shard, jnp.floating)
      and jnp.issubdtype(compute, jnp.floating)
      and jnp.dtype(compute).itemsize < jnp.dtype(shard).itemsize):
    return jnp.dtype(compute)
  return jnp.dtype(shard)


def grad_dtype(how: Any, shard: Any) -> Any:
  """The dtype a scanned layer's gradient shard waits in for the update:
  ``stored_dtype`` for a layer gathered from its float32 shards at stage 3
  (``Materialize.GATHER``, and ``CONSTRAIN`` with a loss of global
  meaning); as the shard's otherwise (a stand-in whose gradient goes to
  host memory under offload, with either loss; stage 2's, ``keep``, which
  stays float32 as its replicated copy's gradients do).

  Args:
    how: the leaf's ``Materializer``.
    shard: the shard's dtype.
  """
  if ((how.kind is Materialize.GATHER and not how.keep) or
      (how.kind is Materialize.CONSTRAIN and not how.to_device
       and not how.grad_to_host)):
    return stored_dtype(shard, how.compute_dtype)
  return jnp.dtype(shard)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def round_grad(x: jax.Array, dtype: Any) -> jax.Array:
  """``x``, whose gradient is rounded to ``dtype`` (and kept in ``x``'s):
  a scan that stacks float32 gradient shards rounds them as
  ``prefetched_scan`` stores them, so the two give the same bits."""
  del dtype
  return x


def _round_fwd(x, dtype):
  del dtype
  return x, None


def _round_bwd(dtype, _, g):
  return (g.astype(dtype).astype(g.dtype),)


round_grad.defvjp(_round_fwd, _round_bwd)


def _kept_backward(res, cotangent, apply, hows, store, acc, n):
  """``prefetched_scan``'s backward where forward kept each gathered layer
  (``Materializer.keep``, stage 2): nothing to gather; each leaf's gradient
  is reduce-scattered as the layer's backward makes it
  (``use_with_scattered_grad``), as the replicated copy's is,
  so that no layer's gradients wait for the next iteration."""
  inputs, kept, shards, floats, consts, fixed = res
  d_out, d_ys = cotangent

  def body(carry, xs):
    d_h, acc = carry
    i, h_in, fl, fx, d_y, kept_i = xs

    def from_kept(h, sh, fl, c):
      full = [use_with_scattered_grad(
          lp, s, k, how.reduce_dtype, how.quantize)
              for (how, lp), s, k in zip(hows, sh, kept_i)]
      return apply(h, full, fl, c, fx)

    _, pull = jax.vjp(from_kept, h_in, _index(shards, i), fl, consts)
    d_in, d_shards, d_fl, d_consts = pull((d_h, d_y))
    return (d_in, store(acc, d_shards, i)), (d_fl, d_consts)

  (d_init, acc), (d_floats, d_consts) = jax.lax.scan(
      body, (d_out, acc),
      (jnp.arange(n), inputs, floats, fixed, d_ys, kept), reverse=True)
  d_shards = [a.astype(sh.dtype) for a, sh in zip(acc, shards)]
  d_consts = jax.tree.map(lambda d: jnp.sum(d, axis=0), d_consts)
  return d_init, d_shards, d_floats, d_consts, [None] * len(fixed)


def prefetched_scan(f: Callable[[Any, Any], tuple[Any, Any]], init: Any,
                    scanned: Sequence[Any], makers: Sequence[Any],
                    treedef: Any) -> tuple[Any, Any]:
  """``scan_layers``'s loop (``remat="full"``) with each layer's gather
  issued one layer ahead, forward and backward.

  Where the materializers keep what they gather (stage 2,
  ``Materializer.keep``), forward saves each gathered layer for backward,
  which then gathers nothing and only reduces.

  Args:
    f: the layer, ``f(carry, layer) -> (carry, y)``.
    init: the initial carry.
    scanned: per leaf of ``xs`` (flattened by ``treedef``): the stacked
      array, or for a ZeRO parameter ``(shard, None)`` (stacked; its
      materializer gathers from the shard itself, ``Materialize.GATHER``).
    makers: per leaf: None, or ``(materializer, slice_plan)``.
    treedef: the structure of ``xs``.

  Returns:
    ``(carry, ys)`` as from ``jax.lax.scan``.
  """
  # Per leaf: a ZeRO parameter, another float array (differentiated), or
  # anything else (integers, keys: passed through, no gradient).
  kinds = ["param" if m is not None else
           "float" if jnp.issubdtype(jnp.result_type(s), jnp.inexact) else
           "fixed" for s, m in zip(scanned, makers)]
  params, floats, fixed = ([s for s, k in zip(scanned, kinds) if k == kind]
                           for kind in ("param", "float", "fixed"))
  hows = [m for m in makers if m is not None]
  keep = any(how.keep for how, _ in hows)
  # What is gathered, and differentiated: the shards themselves.
  shards = [shard for shard, _ in params]
  n = jax.tree.leaves(scanned)[0].shape[0]

  def gather(shards, i):
    # Leaf by leaf, each into its own buffer (XLA combines the collectives;
    # see COMPILER_OPTIONS).
    return [how(lp, sh, None) for (how, lp), sh in
            zip(hows, _index(shards, i))]

  def layer(gathered, floats, fixed):
    parts = {"param": iter(gathered), "float": iter(floats),
             "fixed": iter(fixed)}
    return treedef.unflatten([next(parts[k]) for k in kinds])

  # Closed-over arrays (f may read a table or a weight shared by the layers)
  # become explicit inputs, so that their gradients are returned.
  example = jax.eval_shape(
      lambda sh, fl, fx: layer(gather(sh, 0), _index(fl, 0), _index(fx, 0)),
      shards, floats, fixed)
  f_conv, consts = jax.closure_convert(lambda h, x: f(h, x), init, example)
  steps = jnp.arange(n)

  def apply(h, gathered, floats, consts, fixed):
    return f_conv(h, layer(gathered, floats, fixed), *consts)

  def forward(init, shards, floats, consts, fixed):
    def body(carry, xs):
      h, current = carry
      i, fl, fx = xs
      ahead = gather(shards, jnp.minimum(i + 1, n - 1))
      h_out, y = apply(h, current, fl, consts, fx)
      return (h_out, ahead), (y, h, current if keep else None)

    (h, _), (ys, inputs, kept) = jax.lax.scan(
        body, (init, gather(shards, 0)), (steps, floats, fixed))
    return (h, ys), (inputs, kept)

  @jax.custom_vjp
  def run(init, shards, floats, consts, fixed):
    return forward(init, shards, floats, consts, fixed)[0]

  def run_fwd(init, shards, floats, consts, fixed):
    out, (inputs, kept) = forward(init, shards, floats, consts, fixed)
    return out, (inputs, kept, shards, floats, consts, fixed)

  def run_bwd(res, cotangent):
    inputs, kept, shards, floats, consts, fixed = res
    d_out, d_ys = cotangent

    def reduce(d_gathered, j):
      # Layer j's weight gradients to its shards: the gather's transpose
      # (its primal result unused: XLA drops it).
      _, to_shards = jax.vjp(
          lambda sh: materialize_together(
              hows, [(s, None) for s in sh]), _index(shards, j))
      return to_shards(d_gathered)[0]

    def store(acc, d_shards, j):
      return [jax.lax.dynamic_update_index_in_dim(a, d.astype(a.dtype), j, 0)
              for a, d in zip(acc, d_shards)]

    # Each layer's gradient shards, stored in ``grad_dtype``.
    acc = [jnp.zeros_like(sh, grad_dtype(how, sh.dtype))
           for sh, (how, _) in zip(shards, hows)]
    if keep:
      return _kept_backward(res, cotangent, apply, hows, store, acc, n)

    def body(carry, xs):
      d_h, current, pending, acc = carry
      i, h_in, fl, fx, d_y = xs
      behind = gather(shards, jnp.maximum(i - 1, 0))
      # Layer i+1's gradients, made in the last iteration, are reduced
      # while layer i is differentiated. (In the first iteration, i = L-1,
      # pending is zeros, stored where layer L-1's gradients go next.)
      after = jnp.minimum(i + 1, n - 1)
      acc = store(acc, reduce(pending, after), after)
      _, pull = jax.vjp(lambda h, g, fl, c: apply(h, g, fl, c, fx),
                        h_in, current, fl, consts)
      d_in, d_gathered, d_fl, d_consts = pull((d_h, d_y))
      return (d_in, behind, d_gathered, acc), (d_fl, d_consts)

    # The last layer's gather and the zeros standing for the gradients of
    # a layer after it depend on nothing in forward, so XLA's scheduler
    # would issue them before the forward scan and hold them (two layers)
    # through it; tied to the incoming cotangent, they wait for backward.
    d_out, last, zero = jax.lax.optimization_barrier(
        (d_out, _index(shards, n - 1), jnp.zeros((), jnp.float32)))
    current = [how(lp, sh, None) for (how, lp), sh in zip(hows, last)]
    # (zeros_like keeps the layer's type, device-varying over the mesh,
    # which jax 0.12 checks; adding the barrier's zero makes them wait.)
    pending = jax.tree.map(lambda x: jnp.zeros_like(x) + zero.astype(x.dtype),
                           current)
    (d_init, _, pending, acc), (d_floats, d_consts) = jax.lax.scan(
        body, (d_out, current, pending, acc),
        (steps, inputs, floats, fixed, d_ys), reverse=True)
    d_shards = [a.astype(sh.dtype) for a, sh in
                zip(store(acc, reduce(pending, 0), 0), shards)]
    d_consts = jax.tree.map(lambda d: jnp.sum(d, axis=0), d_consts)
    return d_init, d_shards, d_floats, d_consts, [None] * len(fixed)

  run.defvjp(run_fwd, run_bwd)
  return run(init, shards, floats, list(consts), fixed)
