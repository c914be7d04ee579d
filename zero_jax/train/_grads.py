"""The first half of the step: per-device loss and gradients, reduced into
the ZeRO layout (inside ``shard_map`` over the batch axes). A loss of
global meaning is ``_global``'s.

The stage families differ in three things, each a method of their
strategy: what is differentiated (``wrt``: each gradient comes back with its
argument's layout, so the arguments decide where reduction happens), how
``loss_fn`` gets full parameters from it (``full_params``, through
``zero_jax.materialize.Materializer`` for sharded leaves), and how the
gradients are finished after the last micro-batch (``finish``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zero_jax import materialize
from zero_jax.layers._intercept import intercepting
from zero_jax.layout import ComputeCopy, LeafPlan, Materialize, Placement
from zero_jax.layout._plan import flat, map_leaves
from zero_jax.materialize import _collectives as collectives
from zero_jax.materialize._context import handing_over
from zero_jax.materialize._materializer import HandedParam
from zero_jax.train import _checks

if TYPE_CHECKING:  # (the plan's module imports this one)
  from zero_jax.train._step_plan import StepPlan


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


class GradsStrategy(Protocol):
  """How gradients are made and reduced (``_Local`` at stages 0-1,
  ``_Sharded`` at stages 2-3, by ``strategy``): what is differentiated,
  what ``loss_fn`` gets, the accumulators, and the reduction into the
  update's layout."""

  def wrt(self, params: Any, source: Any) -> Any:
    """What is differentiated, from the master (``params``, None with
    update_on="host") and what forward reads (``source``)."""

  def full_params(self, wrt: Any, source: Any
                  ) -> tuple[Any, list[HandedParam]]:
    """The parameters ``loss_fn`` gets, and the sharded ones among them
    for the ``LossContext``."""

  def zeros(self, lp: LeafPlan, w: jax.Array) -> jax.Array:
    """The micro-batch accumulator of one gradient leaf."""

  def finish(self, g: Any) -> Any:
    """The summed gradients reduced into the layout of the update."""


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
                  ) -> tuple[Any, list[HandedParam]]:
    """The parameters ``loss_fn`` gets, and the sharded ones among them
    for the ``LossContext``."""
    del source
    cd = self.placement.compute_dtype
    return jax.tree.map(lambda x: collectives.cast(x, cd), wrt), []

  def zeros(self, lp: LeafPlan, w: jax.Array) -> jax.Array:
    """The micro-batch accumulator of one gradient leaf."""
    return _varying(collectives.zeros(lp, w.shape, jnp.float32), self.axes)

  def finish(self, g: Any) -> Any:
    """The summed gradients reduced into the layout of the update."""
    # (In the host update's 16-bit dtype where it takes one: the sums are
    # in it already, so nothing is rounded.)
    pl = self.placement
    return collectives.reduce_tree(self.plans, g, pl.reduce_dtype,
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
      z = collectives.zeros(lp, lp.local_shape(self.n),
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
                  ) -> tuple[Any, list[HandedParam]]:
    pl = self.placement
    full, handed = [], []
    for lp, w, src, how in zip(flat(self.plans), jax.tree.leaves(wrt),
                               jax.tree.leaves(source),
                               self._materializers()):
      if not lp.sharded:
        full.append(collectives.cast(w, pl.compute_dtype))
        continue
      if pl.materialize is Materialize.GATHER:
        src = None
      elif pl.materialize is Materialize.SCATTER:
        src = _varying(src, self.axes)
      handed.append(HandedParam.make(lp, w, src, how))
      full.append(handed[-1].array)
    return jax.tree.unflatten(jax.tree.structure(wrt), full), handed

  def zeros(self, lp: LeafPlan, w: jax.Array) -> jax.Array:
    z = collectives.zeros(lp, w.shape, jnp.float32)
    return (jax.lax.pcast(z, lp.axes, to="varying") if lp.sharded else
            _varying(z, self.axes))

  def finish(self, g: Any) -> Any:
    # (In the host update's 16-bit dtype where it takes one: a
    # micro-batch's reduce-scatter is in it already; several micro-batches'
    # float32 sum, or a replicated leaf's, is rounded once.)
    out = self.placement.host_grad_dtype or jnp.float32
    return map_leaves(lambda lp, x: x.astype(out) if lp.sharded else
                      collectives.psum_leaf(lp, x.astype(jnp.float32),
                                            self.axes).astype(out),
                      self.plans, g)


def strategy(placement: Placement, plans: Any, axes: tuple[str, ...],
             n: int, streamed: Any = None) -> GradsStrategy:
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


def loss_and_grads(layout: StepPlan, loss: Loss, params: Any,
                   compute_params: Any, batch: Any, rng: jax.Array,
                   scale: jax.Array | None,
                   seen: dict[str, int] | None = None):
  """Per-device loss and gradients, reduced into the ZeRO layout.

  Gradients come back in float32 whatever the compute dtype (but in
  ``Placement.host_grad_dtype`` where the host's update takes them in it
  and one reduction made them), summed over
  the global batch and every micro-batch, and multiplied by ``scale`` (the
  loss scale, or None).

  Args:
    layout: the ``StepPlan``.
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
  pl = layout.placement
  decided = layout.decisions
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
            handed, layout.remat, decided.remat_names, full=full,
            units=layout.units, layer_classes=decided.layer_classes,
            partition_activations=decided.partition_activations,
            prefetch=layout.prefetch)
        with handing_over(context), intercepting(context):
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
