"""The first half of the step: per-device loss and gradients, reduced into
the ZeRO layout (inside ``shard_map`` over the batch axes).

The stage families differ in three things, each a method of their
strategy: what is differentiated (``wrt``: each gradient comes back with its
argument's layout, so the arguments decide where reduction happens), how
``loss_fn`` gets full parameters from it (``full_params``, through
``zero_jax.materialize.Materializer`` for sharded leaves), and how the
gradients are finished after the last micro-batch (``finish``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zero_jax import layers, materialize
from zero_jax.layout import (ComputeCopy, LeafPlan, Materialize,
                             Placement, flat, map_leaves)
from zero_jax.train import _accumulate, _checks


@dataclasses.dataclass(frozen=True)
class Loss:
  """What the engine trains: ``fn(params, batch) -> loss`` (or ``(loss,
  aux)`` with ``has_aux``; ``fn(params, batch, rng)`` with ``with_rng``),
  the mean loss over the examples it is given; with a global loss over
  micro-batches, ``weight(micro_batch)`` is a micro-batch's weight
  (``Engine(loss_weight=)``, ``_accumulate``)."""

  fn: Callable[..., Any]
  has_aux: bool = False
  with_rng: bool = False
  weight: Callable[[Any], Any] | None = None

  def __call__(self, params: Any, batch: Any, rng: jax.Array
               ) -> tuple[jax.Array, Any]:
    """``(loss, aux)`` (aux None without ``has_aux``), checked."""
    args = (params, batch, rng) if self.with_rng else (params, batch)
    return _checks.split_loss(self.fn(*args), self.has_aux)


def _varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  return jax.lax.pcast(x, axes, to="varying")


@dataclasses.dataclass(frozen=True)
class _Local:
  """Stages 0-1: local full gradients of the whole parameters, reduced at
  the end (all-reduce at stage 0, reduce-scatter at stage 1).

  Replicated leaves are marked device-varying outside the gradient, so their
  gradients stay local and are reduced once after the last micro-batch.
  """

  plans: Any
  placement: Placement
  axes: tuple[str, ...]

  def wrt(self, params: Any, source: Any) -> Any:
    """What is differentiated, from the master (``params``, None with
    update_on="host") and what forward reads (``source``)."""
    del params
    return jax.tree.map(lambda x: _varying(x, self.axes), source)

  def full_params(self, wrt: Any, source: Any
                  ) -> tuple[Any, list[materialize.HandedParam]]:
    """The parameters ``loss_fn`` gets, and the sharded ones among them
    for the ``LossContext``."""
    del source
    cd = self.placement.compute_dtype
    return jax.tree.map(lambda x: materialize.cast(x, cd), wrt), []

  def zeros(self, lp: LeafPlan, w: jax.Array) -> jax.Array:
    """The micro-batch accumulator of one gradient leaf."""
    return _varying(materialize.zeros(lp, w.shape, jnp.float32), self.axes)

  def finish(self, g: Any) -> Any:
    """The summed gradients reduced into the layout of the update."""
    # (In the host update's 16-bit dtype where it takes one: the sums are
    # in it already, so nothing is rounded.)
    pl = self.placement
    return materialize.reduce_tree(self.plans, g, pl.reduce_dtype,
                                   pl.host_grad_dtype or jnp.float32,
                                   pl.quantize)


@dataclasses.dataclass(frozen=True)
class _Sharded:
  """Stages 2-3: each sharded leaf's gradient arrives reduce-scattered as
  backward makes it (``Placement.materialize``): stage 3 from the master,
  and stage 2 gathering it in forward, differentiate the shards themselves
  (the gather's transpose reduce-scatters); stage 2 with a replicated
  copy, and stage 3 from another copy, zero-valued stand-ins of each
  shard. Replicated leaves are differentiated in float32
  as themselves (the master, or with update_on="host", which leaves the
  master on the host, the compute copy widened) and all-reduced at the end.
  The methods are ``_Local``'s.
  """

  plans: Any
  placement: Placement
  axes: tuple[str, ...]
  n: int
  grads_to_host: tuple[bool, ...]

  def _materializers(self) -> list[materialize.Materializer]:
    pl = self.placement
    gather_from = pl.materialize is Materialize.GATHER_FROM
    return [materialize.Materializer(
        pl.materialize, pl.compute_dtype, pl.reduce_dtype,
        to_device=gather_from and pl.gathers_from_host,
        grad_to_host=gather_from and to_host, quantize=pl.quantize,
        keep=pl.keeps_gathered)
            for to_host in self.grads_to_host]

  def wrt(self, params: Any, source: Any) -> Any:
    pl = self.placement
    on_device = ((lambda x: jax.device_put(x, jax.memory.Space.Device))
                 if pl.master_on_host else (lambda x: x))

    def stand_in(lp, to_host):
      # In host memory where the gradients go there: a cotangent lives
      # where its primal does, in its dtype. (Forward never reads it.) The
      # host update's 16-bit dtype, where it takes one, is the
      # reduce-scatter's own: its sums cross as they are, half the bytes,
      # nothing rounded (micro-batches still sum in the float32
      # accumulator).
      z = materialize.zeros(lp, lp.local_shape(self.n),
                            pl.host_grad_dtype or jnp.float32)
      if to_host:
        z = jax.device_put(z, jax.memory.Space.Host)
      return jax.lax.pcast(z, lp.axes, to="varying")

    whole = params if params is not None else source
    shards = pl.materialize is Materialize.GATHER
    out = [(p if shards else stand_in(lp, to_host)) if lp.sharded else
           _varying(on_device(p).astype(jnp.float32), self.axes)
           for lp, p, to_host in zip(flat(self.plans), jax.tree.leaves(whole),
                                     self.grads_to_host)]
    return jax.tree.unflatten(jax.tree.structure(whole), out)

  def full_params(self, wrt: Any, source: Any
                  ) -> tuple[Any, list[materialize.HandedParam]]:
    pl = self.placement
    full, handed = [], []
    for lp, w, src, how in zip(flat(self.plans), jax.tree.leaves(wrt),
                               jax.tree.leaves(source),
                               self._materializers()):
      if not lp.sharded:
        full.append(materialize.cast(w, pl.compute_dtype))
        continue
      if pl.materialize is Materialize.GATHER:
        src = None
      elif pl.materialize is Materialize.SCATTER:
        src = _varying(src, self.axes)
      handed.append(materialize.HandedParam.make(lp, w, src, how))
      full.append(handed[-1].array)
    return jax.tree.unflatten(jax.tree.structure(wrt), full), handed

  def zeros(self, lp: LeafPlan, w: jax.Array) -> jax.Array:
    z = materialize.zeros(lp, w.shape, jnp.float32)
    return (jax.lax.pcast(z, lp.axes, to="varying") if lp.sharded else
            _varying(z, self.axes))

  def finish(self, g: Any) -> Any:
    return map_leaves(lambda lp, x: x if lp.sharded else
                      materialize.psum_leaf(lp, x.astype(jnp.float32),
                                            self.axes),
                      self.plans, g)


def strategy(placement: Placement, plans: Any, axes: tuple[str, ...],
             n: int, streamed: Any = None) -> _Local | _Sharded:
  """The strategy of a placement's stage family.

  Args:
    placement: the engine's placement.
    plans: the parameters' tree of ``LeafPlan``.
    axes: the mesh's batch axes.
    n: devices on ``data``.
    streamed: the leaf indices the streamed update cuts into slices (None:
      every leaf, or no streamed update).
  """
  if placement.materialize is Materialize.LOCAL:
    return _Local(plans, placement, axes)
  # Gradients go to the host for the leaves the update streams slice by
  # slice; small (whole) leaves gain nothing from the round trip.
  # (With update_on="host", every sharded leaf's.)
  grads_to_host = tuple(placement.grads_on_host and (streamed is None or
                                                     l in streamed)
                        for l in range(len(flat(plans))))
  return _Sharded(plans, placement, axes, n, grads_to_host)


def loss_and_grads(layout, loss: Loss, params: Any, compute_params: Any,
                   batch: Any, rng: jax.Array, scale: jax.Array | None,
                   seen: dict[str, int] | None = None):
  """Per-device loss and gradients, reduced into the ZeRO layout.

  Gradients come back in float32 whatever the compute dtype (but in
  ``Placement.host_grad_dtype`` where the host's update takes them in it
  and one reduction made them), summed over
  the global batch and every micro-batch, and multiplied by ``scale`` (the
  loss scale, or None).

  Args:
    layout: the ``Layout``.
    loss: what is trained.
    params: the fp32 master (None with update_on="host").
    compute_params: the compute copy (None where there is none).
    batch: the global batch, laid out as ``layout.batch.sharding``.
    rng: this step's key.
    scale: the loss scale, or None.
    seen: filled while tracing with the blocks run one at a time,
      ``{name: calls}`` (``Engine.describe()`` lists them).

  Returns:
    ``(grads, loss, aux)``: loss and aux averaged over devices.
  """
  if layout.config.loss_scope == "global":
    return _global_loss_and_grads(layout, loss, params, compute_params,
                                  batch, rng, scale, seen)
  pl = layout.placement
  cfg = layout.config
  axes = layout.batch.axes
  accum = layout.batch.grad_accum_steps
  family = layout.grads
  # Scaling by 1/(devices * micro-batches) makes the summed gradient the
  # mean over the global batch.
  divisor = layout.batch.num_devices * accum

  def local(params, compute_params, batch, rng, scale):
    # Forward reads the compute copy wherever there is one.
    source = compute_params if pl.compute_copy else params

    def loss_of(full, batch, key):
      value, aux = loss(full, batch, key)
      scaled = value / divisor
      if scale is not None:
        scaled = scaled * scale
      return scaled, (value, aux)

    wrt = family.wrt(params, source)

    def grads_of(batch, key):
      def loss_of_wrt(wrt):
        full, handed = family.full_params(wrt, source)
        context = materialize.LossContext.of(
            handed, layout.remat, cfg.remat_names, full=full,
            units=layout.units, layer_classes=cfg.layer_classes,
            partition_activations=cfg.partition_activations,
            prefetch=layout.prefetch)
        with materialize.handing_over(context), layers.intercepting(context):
          out = loss_of(full, batch, key)
        if seen is not None:
          seen.update(context.seen)
        return out

      g, (value, aux) = jax.grad(loss_of_wrt, has_aux=True)(wrt)
      return g, value, aux

    key = jax.random.fold_in(rng, jax.lax.axis_index(axes))
    if accum == 1:
      g, value, aux = grads_of(batch, key)
    else:
      # A scan over micro-batches. The accumulator has the layout of the
      # gradients: a full local copy at stages 0-1, shards at stages 2-3.
      micro = jax.tree.map(
          lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]),
          batch)
      acc = map_leaves(family.zeros, layout.param_plan.leaves, wrt)

      def body(acc, xs):
        b, i = xs
        g, value, aux = grads_of(b, jax.random.fold_in(key, i))
        acc = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, g)
        return acc, (value, aux)

      g, (values, auxes) = jax.lax.scan(body, acc,
                                        (micro, jnp.arange(accum)))
      value = jnp.mean(values)
      aux = jax.tree.map(lambda a: jnp.mean(a, axis=0), auxes)
    g = family.finish(g)
    value = jax.lax.pmean(value, axes)
    aux = jax.tree.map(lambda a: jax.lax.pmean(a, axes), aux)
    return g, value, aux

  plan = layout.param_plan
  replicated = plan.replicated_specs
  in_params = (None if params is None else plan.specs
               if pl.master_sharded else replicated)
  in_compute = None if pl.compute_copy is None else (
      replicated if pl.compute_copy is ComputeCopy.REPLICATED else plan.specs)
  grad_specs = plan.specs if pl.grads_sharded else replicated
  # Manual over the batch axes only: over ``model`` (tensor parallelism)
  # the compiler partitions loss_fn by the parameters' specs and inserts
  # the tensor-parallel collectives itself.
  fn = jax.shard_map(local, mesh=layout.mesh,
                     in_specs=(in_params, in_compute,
                               layout.batch.sharding.spec, P(),
                               None if scale is None else P()),
                     out_specs=(grad_specs, P(), P()),
                     axis_names=set(axes))
  return fn(params, compute_params, batch, rng, scale)


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


def describe_loss(config: Any, placement: Placement) -> str:
  """``Engine.describe``'s line on what ``loss_fn``'s value means."""
  if config.loss_scope == "per_device":
    return ("loss: per device (loss_fn on each device's slice of the "
            "batch, averaged: DeepSpeed's meaning)")
  summed = jnp.dtype(placement.reduce_dtype or jnp.float32).name
  return ("loss: global (loss_fn once over the whole batch: one device's "
          f"meaning; every collective the compiler's, gradients summed in "
          f"{summed})")


def hands_over(layout) -> bool:
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


def global_loss(layout, loss: Loss, seen: dict[str, int] | None = None
                ) -> Callable[..., tuple[jax.Array, Any]]:
  """``loss_of(full, batch, key, handed=()) -> (loss, aux)``: the engine's
  loss as the global step calls it, on full (compute-dtype) parameters,
  inside the step's ``LossContext`` (its remat, its layers, the batch's
  sharding). ``handed``: the ``HandedParam`` of each sharded leaf the
  engine gathers itself, a layer at a time in ``scan_layers``."""
  cfg = layout.config

  def loss_of(full, batch, key, handed=()):
    context = materialize.LossContext.of(
        list(handed), layout.remat, cfg.remat_names, full=full,
        units=layout.units,
        layer_classes=cfg.layer_classes,
        partition_activations=cfg.partition_activations,
        prefetch=layout.prefetch, batch_sharding=layout.batch.sharding)
    with materialize.handing_over(context), layers.intercepting(context):
      out = loss(full, batch, key)
    if seen is not None:
      seen.update(context.seen)
    return out

  return loss_of


def _global_loss_and_grads(layout, loss: Loss, params: Any,
                           compute_params: Any, batch: Any, rng: jax.Array,
                           scale: jax.Array | None,
                           seen: dict[str, int] | None = None):
  """``loss_and_grads`` for a loss of global meaning
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
  # (``handing_over``): each scanned layer one layer ahead (prefetch), or
  # one layer at a time from host memory (``offload_params``), each
  # streamed leaf's gradient sent back there as backward makes it
  # (``Placement.grads_on_host``).
  # hpZ's leaves and qwZ's are gathered their own way wherever they are
  # used (``own``), not by the compiler.
  # At stage 2 the replicated copy is read as it is, and only its
  # gradient is handed back as a shard, a layer at a time (``scatters``).
  from_host = pl.gathers_from_host
  scatters = pl.stage == 2
  own = [lp.hierarchical or pl.quantize.weights for lp in leaves]
  hands = hands_over(layout)
  handed = [hands and lp.sharded for lp in leaves]
  to_host = [h and pl.grads_on_host and layout.grads.grads_to_host[i]
             for i, h in enumerate(handed)]
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

  def wrt_of(lp, x, h, t, sharding):
    # What is differentiated. A handed leaf: its float32 shards, cast a
    # layer at a time (a 16-bit copy of every shard would be live through
    # the step), or for shards in host memory, stage 2's replicated copy
    # and a gradient sent to host memory a zero-valued stand-in that takes
    # their gradient as a shard (in host memory too where it goes there).
    # Any other: what forward reads, on the device, in its own layout and
    # in the dtype its gradient is summed in.
    if h:
      return (jax.device_put(jnp.zeros(x.shape, jnp.float32), sharding)
              if from_host or scatters or t else x)
    if pl.master_on_host:
      x = jax.device_put(x, jax.memory.Space.Device)
    return x.astype(pl.reduce_dtype or jnp.float32)

  tree = jax.tree.structure(source)
  wrt = tree.unflatten([wrt_of(*a) for a in zip(
      leaves, jax.tree.leaves(source), handed, to_host, shardings)])
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
      for lp, w, src, h, o, how in zip(leaves, jax.tree.leaves(wrt),
                                       jax.tree.leaves(source), handed, own,
                                       hows):
        if not h:
          full.append(materialize.cast(w, pl.compute_dtype))
          continue
        # (Cast on the shard, copied to the device first from host memory;
        # its gradient reduce-scattered in the reduce dtype. Gathered here
        # if hpZ's or qwZ's; in one reduce-scatter, see gather_constrained.
        # Stage 2's copy: used as it is.)
        src = src if from_host or scatters or how.grad_to_host else None
        full.append(how(lp, w, src) if scatters else
                    materialize.gather_constrained(
                        lp, how.mesh, w, src, how.compute_dtype,
                        how.reduce_dtype, whole=o, to_host=how.grad_to_host,
                        quantize=how.quantize, by_group=False))
        made.append(materialize.HandedParam(full[-1], lp, w, src, how))
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
  # (float32 whatever the host update takes: the micro-batches' sums are
  # float32's, which a 16-bit copy would round where the device's update
  # does not.)
  g = into_layout(_accumulate.finish(acc, total), jnp.float32)
  return (g, _accumulate.combine(weights, values),
          _accumulate.combine(weights, auxes))
