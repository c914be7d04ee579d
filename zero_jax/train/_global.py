"""The first half of the step for a loss of global meaning
(``ZeroConfig.loss_scope="global"``, the default): ``loss_fn`` once over
the global batch, as plain ``jax.jit`` code on the ZeRO layout, with
sharding constraints placing the collectives the engine decides
(``zero_jax.materialize.gather_constrained``, ``use_constrained``) and the
compiler the rest. The per-device loss is ``_grads``'.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp

from zero_jax import materialize
from zero_jax.layers._intercept import intercepting
from zero_jax.layout import Materialize
from zero_jax.layout._plan import flat
from zero_jax.materialize._collectives import cast
from zero_jax.materialize._context import handing_over
from zero_jax.materialize._materializer import HandedParam
from zero_jax.train import _accumulate
from zero_jax.train._grads import Loss

if TYPE_CHECKING:  # (the plan's module imports this one)
  from zero_jax.train._step_plan import StepPlan


# XLA options the global loss's step is compiled with where it does not
# prefetch (with prefetch: layers.GLOBAL_PREFETCH_COMPILER_OPTIONS; GPU
# scheduling, no effect elsewhere): two collectives in flight, so that the
# compiler's gradient reduce-scatters overlap the next layer's backward gemms
# (compiled for 8 H100s, 1.3B GPT: 93% of their bytes, against none with
# XLA's default of one, at commit 8701421); its gathers are left
# uncombined, which keeps their overlap
# (experiments/results/stage3_global_loss_h100.md).
GLOBAL_LOSS_COMPILER_OPTIONS = {
    "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
}


def hands_over(layout: StepPlan) -> bool:
  """Whether a step with a loss of global meaning hands its sharded
  parameters to the loss itself, with sharding constraints that place
  their collectives, rather than leave them where the compiler puts them:
  at stages 2-3. At stage 3 each scanned layer is gathered one layer ahead
  (prefetch) or at the top of its iteration, from host memory with
  ``offload_params``, hpZ's and qwZ's own way (``gather_constrained``);
  at stage 2 each layer's gradient is reduce-scattered where backward
  makes it (``use_constrained``). Blocks called in a Python loop then run
  one at a time, each rematerialized, as in the per-device step."""
  return layout.placement.stage >= 2


def global_loss(layout: StepPlan, loss: Loss, seen: dict[str, int] | None = None
                ) -> Callable[..., tuple[jax.Array, Any]]:
  """``loss_of(full, batch, key, handed=()) -> (loss, aux)``: the engine's
  loss as the global step calls it, on full (compute-dtype) parameters,
  inside the step's ``LossContext`` (its remat, its layers, the batch's
  sharding). ``handed``: the ``HandedParam`` of each sharded leaf the
  engine gathers itself, a layer at a time in ``scan_layers``."""
  decided = layout.decisions

  def loss_of(full, batch, key, handed=()):
    context = materialize.LossContext.of(
        list(handed), layout.remat, decided.remat_names, full=full,
        units=layout.units,
        layer_classes=decided.layer_classes,
        partition_activations=decided.partition_activations,
        prefetch=layout.prefetch, batch_sharding=layout.batch.sharding)
    with handing_over(context), intercepting(context):
      out = loss(full, batch, key)
    if seen is not None:
      seen.update(context.seen)
    return out

  return loss_of


def loss_and_grads(layout: StepPlan, loss: Loss, params: Any,
                   compute_params: Any, batch: Any, rng: jax.Array,
                   scale: jax.Array | None,
                   seen: dict[str, int] | None = None):
  """``_grads.loss_and_grads`` for a loss of global meaning
  (``ZeroConfig.loss_scope="global"``).

  ``loss_fn`` runs once, over the global batch, as plain ``jax.jit`` code
  on the layout's own arrays: what forward reads (the fp32 master shards at
  stage 3, the replicated compute copy at stages 0-2), cast to the compute
  dtype where they are read. Every collective is the compiler's (GSPMD's,
  as in MaxText's FSDP): it gathers a sharded parameter where the loss
  uses it and reduce-scatters its gradient into the shard, and all-reduces
  a replicated one's. The loss's own reductions over the batch (a masked
  mean's count, a contrastive loss's negatives, a batch statistic) are
  therefore over the whole batch, as on one device. With prefetch
  (stage 3), the float32 shards themselves are differentiated and handed
  over: ``scan_layers`` gathers each layer one layer ahead by sharding
  constraints (``Materialize.CONSTRAIN``), and every other sharded leaf is
  cast on its shard, its gradient reduce-scattered in the reduce dtype.
  With ``offload_params`` the shards are read from host memory, a layer at
  a time, and zero-valued stand-ins on the device take their gradients.
  The explicit regions
  of the per-device step cannot carry this on jax 0.10-0.12: a gather
  typed ``reduced`` loses its type through a slice or a cast and the
  gradient comes out N times too large (``experiments/loss_regions.py``).
  Over micro-batches (``grad_accum_steps > 1``), a scan: each
  micro-batch's gradients, summed by the compiler into the update's layout,
  are accumulated at its share of the weight (``_accumulate``).
  """
  pl = layout.placement
  source = compute_params if pl.compute_copy else params
  plan = layout.param_plan
  leaves = flat(plan.leaves)
  # The sharded leaves the engine gathers itself, by sharding constraints
  # (``handing_over``): each scanned layer one layer ahead (prefetch), at
  # the top of its iteration, or from host memory (``offload_params``),
  # each streamed leaf's gradient sent to host memory as backward makes it
  # (``Placement.grads_on_host``).
  # hpZ's leaves and qwZ's are gathered their own way wherever they are
  # used (``own``), not by the compiler.
  # At stage 2 the replicated copy is read as it is, and only its
  # gradient is handed back as a shard, a layer at a time (``scatters``).
  # Where what is read is not what takes the gradient (host memory, stage
  # 2's copy, a gradient sent to host memory), a zero-valued stand-in of
  # the shard takes it (``stands_in``).
  from_host = pl.gathers_from_host
  scatters = pl.stage == 2
  own = [lp.hierarchical or pl.quantize.weights for lp in leaves]
  hands = hands_over(layout)
  handed = [hands and lp.sharded for lp in leaves]
  to_host = [h and pl.grads_on_host and layout.grads.grads_to_host[i]
             for i, h in enumerate(handed)]
  stands_in = [h and (from_host or scatters or t)
               for h, t in zip(handed, to_host)]
  hows = [materialize.Materializer(
      Materialize.CONSTRAIN_SCATTER if scatters else Materialize.CONSTRAIN,
      pl.compute_dtype, pl.reduce_dtype,
      to_device=from_host, grad_to_host=t, quantize=pl.quantize,
      mesh=layout.mesh) for t in to_host]
  out = pl.host_grad_dtype or jnp.float32
  shardings = [s.with_memory_kind("pinned_host") if t else s
               for s, t in zip(jax.tree.leaves(
                   plan.shardings if pl.grads_sharded else
                   plan.replicated_shardings), to_host)]

  def wrt_of(x, h, stand_in, sharding):
    # What is differentiated. A handed leaf: its float32 shards, cast a
    # layer at a time (a 16-bit copy of every shard would be live through
    # the step), or its stand-in, in the dtype the update takes (the host
    # update's 16-bit one: the sums are in it already) and in host memory
    # where the gradient goes there. Any other: what forward reads, on the
    # device, in its own layout and in the dtype its gradient is summed
    # in.
    if stand_in:
      return jax.device_put(jnp.zeros(x.shape, out), sharding)
    if h:
      return x
    if pl.master_on_host:
      x = jax.device_put(x, jax.memory.Space.Device)
    return x.astype(pl.reduce_dtype or jnp.float32)

  tree = jax.tree.structure(source)
  wrt = tree.unflatten([wrt_of(*a) for a in zip(
      jax.tree.leaves(source), handed, stands_in, shardings)])
  call = global_loss(layout, loss, seen)

  def into_layout(g, dtype=out):
    # Into the update's layout: the compiler sums each gradient there
    # (reduce-scatter, or all-reduce of a replicated one).
    return tree.unflatten([
        jax.lax.with_sharding_constraint(x.astype(dtype), sharding)
        for x, sharding in zip(jax.tree.leaves(g), shardings)])

  def grads_of(batch, key):
    def loss_of_wrt(wrt):
      full, made = [], []
      for lp, w, src, h, o, how, stand_in in zip(
          leaves, jax.tree.leaves(wrt), jax.tree.leaves(source), handed,
          own, hows, stands_in):
        if not h:
          full.append(cast(w, pl.compute_dtype))
          continue
        # (Cast on the shard, copied to the device first from host memory;
        # its gradient reduce-scattered in the reduce dtype. Gathered here
        # if hpZ's or qwZ's; in one reduce-scatter, see gather_constrained.
        # Stage 2's copy: used as it is.)
        src = src if stand_in else None
        full.append(how(lp, w, src) if scatters else
                    materialize.gather_constrained(
                        lp, how.mesh, w, src, how.compute_dtype,
                        how.reduce_dtype, whole=o, to_host=how.grad_to_host,
                        quantize=how.quantize, by_group=False))
        made.append(HandedParam(full[-1], lp, w, src, how))
      value, aux = call(tree.unflatten(full), batch, key, made)
      return (value if scale is None else value * scale), (value, aux)

    g, (value, aux) = jax.grad(loss_of_wrt, has_aux=True)(wrt)
    return into_layout(g), value, aux

  split = _accumulate.Split.of(layout, loss)
  if split.steps == 1:
    return grads_of(batch, rng)
  micro = split.micro_batches(batch)
  weights = split.weights(micro)
  total = jnp.sum(weights)
  acc = tree.unflatten([
      jax.lax.with_sharding_constraint(jnp.zeros(x.shape, jnp.float32),
                                       sharding)
      for x, sharding in zip(jax.tree.leaves(wrt), shardings)])

  def body(acc, xs):
    b, w, i = xs
    g, value, aux = grads_of(b, jax.random.fold_in(rng, i))
    return _accumulate.add(acc, g, w, total), (value, aux)

  acc, (values, auxes) = jax.lax.scan(
      body, acc, (micro, weights, jnp.arange(split.steps)))
  # (To the host update in its 16-bit dtype, ZeRO-Offload's 2 bytes a
  # parameter: the micro-batches' float32 sum rounded once.)
  g = into_layout(_accumulate.finish(acc, total))
  return (g, _accumulate.combine(weights, values),
          _accumulate.combine(weights, auxes))
