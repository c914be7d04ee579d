"""The second half of the step: from reduced gradients to the new state.

``prepare`` turns summed gradients into the ones to apply (unscaled, their
global norm, the finite check and loss scale, clipping, the skip count).
Where the update runs is the layout's ``update`` strategy, one of three
with the interface of ``UpdateStrategy``:

- ``OnDevice``: ``tx`` on the sharded state in device memory;
- ``Streamed`` (``zero_jax.train._offloaded``): offloaded state streamed
  through the device a slice at a time;
- ``OnHost`` (likewise): ZeRO-Offload's split, a program of its own on the
  host's CPU devices.

These run outside ``shard_map``, on global (sharded) arrays, so norms and
any optax transformation are exact.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from zero_jax import layers
from zero_jax.layout import (DATA, MODEL, ComputeCopy, Prefetch, UpdateKind,
                             plan_leaf)
from zero_jax.layout._plan import flat
from zero_jax.materialize._collectives import gather_replicated
from zero_jax.train import _global, _init, _loss_scale
from zero_jax.train._state import TrainState, compute_copy, on_device

if TYPE_CHECKING:  # (the plan's module imports this one)
  from zero_jax.train._step_plan import StepPlan


class Prepared(NamedTuple):
  """What ``prepare`` returns.

  Attributes:
    grads: the gradients to apply (unscaled and clipped, unless streamed:
      then as given, and ``grad_fn`` does both a slice at a time).
    finite: whether to apply them (None: always).
    grad_fn: with ``stats``, what each gradient slice goes through.
    loss_scale: the ``LossScaleState`` after this step (as given when no
      state is kept).
    metrics: ``grad_norm``, the skip flags and count and ``loss_scale``
      where they apply.
    overflow_at_min: float16 loss scaling: the step overflowed at the minimum
      scale (training has diverged); else None. Not a metric: the step
      function raises on it.
  """

  grads: Any
  finite: jax.Array | None
  grad_fn: Callable[[jax.Array], jax.Array] | None
  loss_scale: Any
  metrics: dict[str, Any]
  overflow_at_min: jax.Array | None


def prepare(layout: StepPlan, grads: Any, step: jax.Array, loss_scale: Any,
            stats: Callable[..., tuple[jax.Array, jax.Array]] | None = None,
            slices: list[P | None] | None = None) -> Prepared:
  """From summed gradients to the ones to apply: unscaled (float16),
  their global norm, one overflow flag, the loss scale's update, and
  clipping. Every update strategy runs it.

  With ``stats`` (``Streamer.grad_stats``) the gradients are in host
  memory: their norm and finiteness are read a slice at a time, and the
  update unscales and clips each slice as it reads it (through the
  returned ``grad_fn``).

  ``slices`` (``norm_slices``), per gradient leaf: the layout its norm is
  read in, where that splits a gradient that reaches the update whole on
  every device.
  """
  pl = layout.placement
  decided = layout.decisions
  scale = loss_scale.scale if pl.loss_scaling else None
  unscale = (lambda g: g) if scale is None else (lambda g: g / scale)
  all_finite = None
  if stats is not None:
    norm, all_finite = stats(grads, unscale)
  else:
    grads = jax.tree.map(unscale, grads)
    # Outside shard_map the gradients are global (sharded) arrays, so the
    # norm is over the whole model, exactly; XLA inserts the reduction.
    norm = jnp.sqrt(_squared_norm(layout, grads, slices))
    if pl.loss_scaling:
      # One flag for the whole model: an overflow in any shard on any
      # device skips the update everywhere (jnp.all over global arrays
      # reduces across devices).
      all_finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g))
                                      for g in jax.tree.leaves(grads)]))
  clip = lambda g: g
  if decided.clip_grad_norm is not None:
    c = decided.clip_grad_norm
    # optax.clip_by_global_norm's formula, on the norm already computed.
    clip = lambda g: jnp.where(norm < c, g, g / norm.astype(g.dtype) * c)
  grad_fn = None
  if stats is not None:
    grad_fn = lambda g: clip(unscale(g))
  else:
    grads = jax.tree.map(clip, grads)
  metrics = {"grad_norm": norm}
  finite = at_min = None
  if not pl.loss_scaling and decided.skip_nonfinite:
    # A NaN or inf anywhere makes the global norm non-finite: one scalar
    # check skips the update on every device.
    finite = jnp.isfinite(norm)
    skipped = jnp.logical_not(finite)
    loss_scale = dataclasses.replace(
        loss_scale, skipped=loss_scale.skipped + skipped.astype(jnp.int32))
    metrics.update(skipped=skipped, skipped_steps=loss_scale.skipped)
  if pl.loss_scaling:
    finite = all_finite
    loss_scale, at_min = _loss_scale.update(loss_scale, finite,
                                           decided.loss_scaling)
    metrics.update(loss_scale=scale, skipped=jnp.logical_not(finite),
                   skipped_steps=loss_scale.skipped)
  return Prepared(grads, finite, grad_fn, loss_scale, metrics, at_min)


def norm_slices(layout: StepPlan) -> list[P | None]:
  """Per gradient leaf, the slice ``prepare`` reads of it on each device
  for the global norm: the leaf split over ``data`` as stage 3 splits it
  (a spec over the batch axes), where the gradient reaches the update
  whole on every device (stage 0, and the leaves a stage keeps whole,
  where a dimension divides); None where it is split already or stays
  whole.

  Each device then squares 1/N of such a gradient and one all-reduce of a
  scalar adds the devices' sums, where every device would read the whole
  model (at stage 0 that was 4-11% of the step's CPU time: the GPT of
  ``experiments/cpu_overhead.py``, 8 CPU devices).
  """
  mesh = layout.mesh
  n = mesh.shape[DATA]
  m = dict(mesh.shape).get(MODEL, 1)
  decided = layout.decisions
  out = []
  for lp in flat(layout.param_plan.leaves):
    sl = None if lp.sharded else plan_leaf(
        lp.shape, n, 3, decided.min_shard_elements, lp.model, m)
    out.append(sl.spec if sl is not None and sl.sharded else None)
  return out


def _squared_norm(layout: StepPlan, grads: Any, slices: list[P | None] | None
                  ) -> jax.Array:
  """The squared global norm of ``grads``, the leaves with a slice in
  ``slices`` summed a slice per device (``norm_slices``)."""
  leaves = jax.tree.leaves(grads)
  slices = slices or [None] * len(leaves)
  whole = [g for g, sl in zip(leaves, slices) if sl is None]
  split = [g for g, sl in zip(leaves, slices) if sl is not None]
  total = optax.tree.norm(whole, squared=True) if whole else 0.0
  if not split:
    return total

  def local(*xs):
    return jax.lax.psum(sum(jnp.sum(jnp.square(x)) for x in xs), DATA)

  # Manual over ``data`` only: across ``replica`` groups (which hold the
  # same gradients) the sum is the same, and over ``model`` the compiler
  # partitions it itself.
  return total + jax.shard_map(
      local, mesh=layout.mesh, in_specs=tuple(s for s in slices
                                              if s is not None),
      out_specs=P(), axis_names={DATA})(*split)


def injected_learning_rate(opt_state: Any) -> jax.Array | None:
  """The learning rate of the last update applied, where ``tx`` was built
  with ``optax.inject_hyperparams`` (its state holds the rate it used);
  None if no such state, or more than one, holds a ``learning_rate``."""
  kinds = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
  found = [s.hyperparams["learning_rate"] for s in jax.tree.leaves(
      opt_state, is_leaf=lambda x: isinstance(x, kinds))
           if isinstance(s, kinds) and "learning_rate" in s.hyperparams]
  return found[0] if len(found) == 1 else None


def grad_shardings(layout: StepPlan) -> Any:
  """Where the gradients reach the update: sharded like the master's plan
  (stages 1-3), or replicated like the master at stage 0."""
  return (layout.param_plan.shardings if layout.placement.grads_sharded else
          layout.device_params)


class StepOutputs(NamedTuple):
  """What the jitted step returns (``UpdateStrategy.finish``), read on the
  host by the strategy's ``after``.

  Attributes:
    state: the new state (the device's part of it, with the update on the
      host).
    metrics: the step's metrics.
    overflow_at_min: float16 only: the step overflowed at the minimum loss
      scale (``engine.step`` raises); None otherwise.
    grads: with the update on the host: the reduced gradients it takes;
      None otherwise.
  """

  state: TrainState
  metrics: dict[str, Any]
  overflow_at_min: jax.Array | None = None
  grads: Any = None


def new_state(layout: StepPlan, state: TrainState, master: Any, opt_state: Any,
              device_master: Any, prepared: Prepared,
              metrics: dict[str, Any]) -> StepOutputs:
  """The jitted step's outputs from the updated master and optimizer
  state: the compute copy refreshed from the new master (on the device),
  the learning rate where ``tx`` reports one."""
  pl = layout.placement
  compute_params = None
  if pl.compute_copy is ComputeCopy.REPLICATED:
    compute_params = gather_replicated(
        layout.param_plan, device_master, pl.compute_dtype)
  elif pl.compute_copy is ComputeCopy.SHARDED:
    compute_params = compute_copy(pl, device_master)
  elif pl.master_regathered:
    master = gather_replicated(layout.param_plan, device_master)
  lr = injected_learning_rate(opt_state)
  if lr is not None:
    # (Offloaded: the scalar comes up from host memory with the metrics.)
    metrics["learning_rate"] = jax.device_put(
        lr, on_device(layout.state_shardings.step))
  return StepOutputs(
      TrainState(step=state.step + 1, params=master, opt_state=opt_state,
                 rng=state.rng, compute_params=compute_params,
                 loss_scale=prepared.loss_scale), metrics,
      overflow_at_min=prepared.overflow_at_min)


class UpdateStrategy(Protocol):
  """Where and how the optimizer update runs: ``OnDevice``, ``Streamed``
  or ``OnHost``, one per ``UpdateKind``. The step's first half (loss and
  reduced gradients) is the same for all three."""

  kind: UpdateKind

  def jit(self, layout: StepPlan, fn: Callable[..., Any]) -> Any:
    """The ``jax.jit`` of the device's step ``fn(state, batch)``."""

  def finish(self, layout: StepPlan, state: TrainState, grads: Any,
             metrics: dict[str, Any]) -> StepOutputs:
    """Inside the jitted step, after the gradients: its outputs."""

  def device_input(self, state: TrainState) -> TrainState:
    """What of the state the device's step takes."""

  def after(self, layout: StepPlan, state: TrainState, outputs: StepOutputs,
            carry: Any) -> tuple[TrainState, dict[str, Any], Any, Any]:
    """On the host, after the jitted call: ``(state, metrics,
    overflow_at_min, carry)``. ``carry`` is all the strategy keeps from
    one step to the next (None at first and after ``reset``; the
    ``StepFunction`` holds it): ``OnHost``'s ``HostCarry``, else None."""

  def initializer(self, layout: StepPlan, params: Any
                  ) -> tuple[Callable[..., TrainState], tuple]:
    """The jitted function that builds the first state, and its arguments
    as ``jax.ShapeDtypeStruct`` trees with shardings."""

  def init(self, layout: StepPlan, params: Any) -> TrainState:
    """The first state, from the caller's parameters (copied)."""

  def compute_copy(self, layout: StepPlan, master: Any) -> Any:
    """The compute copy cast from a restored master."""

  def adopt(self, state: TrainState) -> TrainState:
    """A restored state as this strategy keeps it (the fused host
    optimizer copies master and optimizer state into its buffers)."""

  def live(self, x: Any) -> bool:
    """Whether a numpy leaf of a state is this strategy's live host
    state."""

  def to_device(self, tree: Any, shardings: Any) -> Any:
    """State leaves (``params`` or ``opt_state``) moved to ``shardings``
    on the mesh."""

  def describe(self, layout: StepPlan) -> list[str]:
    """``Engine.describe()``'s lines on the update."""


def compiler_options(layout: StepPlan) -> dict[str, Any] | None:
  """The XLA options the step is compiled with: prefetch's (with a loss
  of global meaning, ``layers.GLOBAL_PREFETCH_COMPILER_OPTIONS``), the
  global loss's (``_global.GLOBAL_LOSS_COMPILER_OPTIONS``), or none."""
  glob = layout.decisions.global_loss
  if layout.prefetch is not Prefetch.OFF:
    return (layers.GLOBAL_PREFETCH_COMPILER_OPTIONS if glob else
            layers.PREFETCH_COMPILER_OPTIONS)
  if glob:
    return _global.GLOBAL_LOSS_COMPILER_OPTIONS
  return None


@dataclasses.dataclass(frozen=True)
class OnDevice:
  """The update on whole (sharded) arrays in device memory."""

  kind = UpdateKind.DEVICE

  def jit(self, layout: StepPlan, fn):
    # (The third output: the overflow-at-minimum-scale flag engine.step
    # reads, not a metric.)
    r = layout.replicated
    return jax.jit(fn, donate_argnums=0,
                   out_shardings=StepOutputs(layout.state_shardings, r, r),
                   compiler_options=compiler_options(layout))

  def finish(self, layout: StepPlan, state, grads, metrics):
    prepared = prepare(layout, grads, state.step, state.loss_scale,
                       slices=norm_slices(layout))
    metrics.update(prepared.metrics)
    master, opt_state = whole_update(
        layout.tx, state.params, state.opt_state, prepared.grads,
        grad_shardings(layout), layout.device_opt, prepared.finite)
    return new_state(layout, state, master, opt_state, master, prepared,
                     metrics)

  def device_input(self, state):
    return state

  def after(self, layout: StepPlan, state, outputs, carry):
    del layout, state
    return outputs.state, outputs.metrics, outputs.overflow_at_min, carry

  def initializer(self, layout: StepPlan, params):
    return _init.whole_initializer(layout, params)

  def init(self, layout: StepPlan, params):
    return _init.placed(layout, params, *self.initializer(layout, params))

  def compute_copy(self, layout: StepPlan, master):
    return _init.cast_copy(layout, master)

  def to_device(self, tree, shardings):
    return jax.device_put(tree, shardings)

  def adopt(self, state):
    return state

  def live(self, x):
    del x
    return False

  def describe(self, layout: StepPlan):
    del layout
    return []


def whole_update(tx: optax.GradientTransformation, master: Any,
                 opt_state: Any, grads: Any, shards: Any, opt_shards: Any,
                 finite: jax.Array | None) -> tuple[Any, Any]:
  """The update on whole (sharded) arrays in device memory.

  Returns:
    The new ``(master, opt_state)`` in the layout of ``shards`` and
    ``opt_shards``.
  """
  # (Stages 1-2 with fp32 compute: slicing the replicated master to its
  # shard is local, no communication.)
  master = jax.device_put(master, on_device(shards))
  opt_state = jax.device_put(opt_state, on_device(opt_shards))

  def apply(master, opt_state):
    updates, new_opt = tx.update(grads, opt_state, master)
    return optax.apply_updates(master, updates), new_opt

  if finite is None:
    return apply(master, opt_state)
  return jax.lax.platform_dependent(master, opt_state, cpu=_skipped_by_cond(
      apply, finite), default=_skipped_by_select(apply, finite))


# A skipped step keeps the old state, and each compiler wants it said its
# own way. The GPU compilers fuse a select into each leaf's update loop,
# where a lax.cond keeps the old and the new state apart (the 1.3B GPT's
# stage-3 step compiled for one H100: 37.0 GiB against 27.3). XLA:CPU,
# given the select, first copies the optimizer state (its copy insertion
# cannot tell that the parameters' update reads the old moments before
# theirs are overwritten in place): two fp32 copies of the model per step
# and device, which made the stage-0 CPU step of experiments/cpu_overhead.py
# 1.6x plain data parallelism's. Its lax.cond updates in place, copying
# nothing.


def _skipped_by_select(apply: Callable[[Any, Any], tuple[Any, Any]],
                       finite: jax.Array) -> Callable[[Any, Any], tuple]:
  """The update, its result selected per element against the old state."""

  def update(master, opt_state):
    new = apply(master, opt_state)
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new,
                        (master, opt_state))

  return update


def _skipped_by_cond(apply: Callable[[Any, Any], tuple[Any, Any]],
                     finite: jax.Array) -> Callable[[Any, Any], tuple]:
  """The update under a ``lax.cond``: the old state when not ``finite``."""
  return lambda master, opt_state: jax.lax.cond(
      finite, apply, lambda m, o: (m, o), master, opt_state)
