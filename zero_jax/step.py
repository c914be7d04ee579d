"""``engine.step``: the jitted train step, its body, and the host-side
checks around it (the state and batch it is given, overflow and skip flags
read one step late).

These are the ``Engine``'s own parts, split off to be read on their own:
they read the layout the engine built in ``init`` (``engine._streamer``,
``engine._host``...).
"""
# pylint: disable=protected-access

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from zero_jax import (auto_remat, checks, distributed, grads as grads_lib,
                      update)
from zero_jax.plan import map_leaves
from zero_jax.state import TrainState, compute_copy, device_part, on_device


class StepFunction:
  """``engine.step``: the jitted train step plus batch placement.

  ``state, metrics = engine.step(state, batch)``. ``batch`` is a pytree of
  arrays whose leading dimension is the global batch (divisible by the number
  of devices); host (numpy) leaves are placed on the mesh first (in
  multi-process runs each process passes its own slice of the global batch).
  ``state`` is donated. ``metrics`` holds ``"loss"`` (the mean over the global
  batch), ``"grad_norm"`` (the global gradient norm over the whole model,
  before clipping), ``"learning_rate"`` (the rate of the last
  update applied) when ``tx`` was built with ``optax.inject_hyperparams``
  (or the deprecated ``lr_schedule`` was given), with float16 loss scaling ``"loss_scale"`` (the scale
  this step used), ``"skipped"`` (this step overflowed and changed nothing
  but the scale) and ``"skipped_steps"`` (the running total); in fp32 and
  bf16 with ``skip_nonfinite`` (the default), ``"skipped"``: the gradient
  norm was NaN or inf, and the step changed nothing but the step counter
  and ``"skipped_steps"``, the running total; and, with
  ``has_aux``, ``"aux"``.

  An overflow at the minimum loss scale, or ``max_consecutive_skips``
  non-finite steps in a row, means training has diverged: the next call
  raises ``FloatingPointError`` (checked one step late, so the host never
  waits for the step it has just dispatched).

  Before anything reaches XLA, ``state`` is checked (not donated to an
  earlier step; this engine's tree, shapes, dtypes and devices: a state of
  another engine is converted by saving and restoring it through
  ``Checkpointer``), and so is ``batch`` (one leading dimension, not zero).

  ``engine.step.lower(state, batch)`` returns the jitted step's ``Lowered``,
  so ``.compile()`` gives the compiled step for memory and HLO analysis;
  ``engine.step.jitted`` is the raw ``jax.jit`` function. Both return
  ``(state, metrics, overflow_at_min)``: the third output is internal, the
  flag this wrapper raises on (None without float16 loss scaling). (With
  ``update_on="host"`` the jitted function is the device's program: it
  takes the state without ``params`` and ``opt_state``, and returns the
  gradients for the host's update beside the state and metrics.)
  """

  def __init__(self, engine):
    self._engine = engine
    # The host's update (update_on="host") is jitted per prepare function:
    # one, made once.
    self._host_prepare = functools.partial(update.host_prepare, engine)
    self._at_min = None  # the previous step's overflow-at-minimum flag
    self._skipped = []  # skip flags (non-finite norm) not yet read
    self._skips = 0  # skipped steps in a row, up to the previous one
    self._returned = None  # the state the previous step returned

  @property
  def jitted(self):
    """The raw ``jax.jit`` step (with update_on="host", the device's
    program); see the class docstring for what it returns."""
    if self._engine._jitted is None:
      raise RuntimeError("call engine.init(params) before engine.step: the "
                         "step is built for the layout of those params")
    return self._engine._jitted

  def __call__(self, state: TrainState, batch: Any):
    self.check()
    engine = self._engine
    if engine.remat == "auto":
      auto_remat.choose(engine, state, batch, build_jit)
    jitted = self.jitted
    if state is not self._returned:
      # (The state the last step returned is known good: skip the walk.)
      checks.check_state(state, engine._shapes, engine.state_shardings)
    checks.check_batch(batch)
    batch = engine.shard_batch(batch)
    if engine._host is None:
      state, metrics, self._at_min = jitted(state, batch)
    else:
      state, metrics, self._at_min = self._host_step(state, batch)
    if not engine.placement.loss_scaling and engine.config.skip_nonfinite:
      self._skipped.append(metrics["skipped"])
    self._returned = state
    # The launcher's watchdog (--watchdog) sees progress. (The skip flag
    # read at the next call waits for this step, so a hung step stops it.)
    distributed.step_done()
    return state, metrics

  def check(self) -> None:
    """Raises if the last step overflowed at the minimum loss scale, or
    ended ``max_consecutive_skips`` non-finite steps in a row. (Read one step
    late, so the host never waits for the step it has just dispatched.)"""
    cfg = self._engine.config
    flag, self._at_min = self._at_min, None
    if flag is not None and bool(flag):
      raise FloatingPointError(
          f"float16 gradients overflowed at the minimum loss scale "
          f"{cfg.min_loss_scale} (ZeroConfig.min_loss_scale): training has "
          "diverged. Lower the learning rate, clip gradients "
          "(clip_grad_norm), lower min_loss_scale, or train in bfloat16.")
    # (Two steps late with delay_update, whose host update of the last
    # step runs while the device computes this one.)
    lag = 2 if cfg.delay_update else 1
    while len(self._skipped) >= lag:
      self._skips = self._skips + 1 if bool(self._skipped.pop(0)) else 0
      if self._skips >= cfg.max_consecutive_skips:
        raise FloatingPointError(
            f"the last {self._skips} steps had a non-finite gradient norm "
            "(NaN or inf) and were skipped (ZeroConfig.skip_nonfinite; "
            f"max_consecutive_skips={cfg.max_consecutive_skips}): training "
            "has diverged or the data holds NaN/inf. Check the batches, "
            "lower the learning rate or clip gradients (clip_grad_norm), "
            "then resume from the last checkpoint.")

  def lower(self, state: TrainState, batch: Any):
    """The jitted step's ``Lowered`` for this state and batch (arrays or
    ``jax.ShapeDtypeStruct``)."""
    if self._engine.remat == "auto":
      auto_remat.choose(self._engine, state, batch, build_jit)
    jitted = self.jitted
    if self._engine._host is not None:
      state = device_part(state)
    return jitted.lower(state, self._engine.shard_batch(batch))

  def _host_step(self, state: TrainState, batch: Any):
    """``step`` with update_on="host": the device's program, then the
    host's update (dispatched asynchronously, like any jitted call)."""
    new, metrics, grads = self.jitted(device_part(state), batch)
    engine = self._engine
    master, opt_state, copy, (loss_scale, more, at_min) = engine._host.update(
        grads, state.params, state.opt_state,
        {"step": state.step, "loss_scale": state.loss_scale},
        prepare=self._host_prepare, compute_dtype=engine.placement.copy_dtype)
    metrics.update(more)
    lr = update.injected_learning_rate(opt_state)
    if engine.lr_schedule is None and lr is not None:
      metrics["learning_rate"] = lr  # (on the host's CPU devices)
    if loss_scale is not None:
      loss_scale = jax.device_put(loss_scale, engine.state_shardings.loss_scale)
    to_device = lambda c: jax.device_put(c,
                                         engine.state_shardings.compute_params)
    if not engine.config.delay_update:
      compute = to_device(copy)
    else:
      # The next step reads the copy this step's update started from (made
      # by the last step's update, sent up now), not the one being made: the
      # device need not wait for the host, whose update of this step runs
      # while the device computes the next. (Only for the state the last
      # step returned; after init or a restore the state's own copy.)
      pending, engine._pending = engine._pending, (master, copy)
      compute = (to_device(pending[1])
                 if pending and pending[0] is state.params
                 else state.compute_params)
    if compute is not state.compute_params:
      # The state is donated: its compute copy goes before the new one
      # comes, so the device holds no more copies than it must.
      for x in jax.tree.leaves(state.compute_params):
        x.delete()
    return dataclasses.replace(
        new, params=master, opt_state=opt_state, loss_scale=loss_scale,
        compute_params=compute), metrics, at_min


def build_jit(engine) -> Any:
  """The ``jax.jit`` of ``train_step`` for the engine's layout (traced
  anew: the engine's remat policy is read when it is traced)."""
  pl = engine.placement
  replicated = NamedSharding(engine.mesh, P())
  fn = functools.partial(train_step, engine)
  if engine._host is None:
    # (The third output: the overflow-at-minimum-scale flag engine.step
    # reads, not a metric.)
    return jax.jit(fn, donate_argnums=0, out_shardings=(
        engine.state_shardings, replicated, replicated))
  # The device's program: gradients out for the host's update (in host
  # memory where backward sends them there). Nothing is donated: no output
  # takes an input's place; the step deletes the old compute copy once
  # this is dispatched.
  grads = (engine.param_plan.shardings if pl.grads_sharded else
           jax.tree.map(lambda _: replicated, engine.param_plan.shardings))
  if pl.grads_on_host:
    grads = map_leaves(
        lambda lp, sh: sh.with_memory_kind("pinned_host") if lp.sharded
        else sh, engine.param_plan.leaves, grads)
  return jax.jit(fn, out_shardings=(dataclasses.replace(
      device_part(engine.state_shardings), compute_params=None,
      loss_scale=None), replicated, grads))


def train_step(engine, state: TrainState, batch: Any):
  """The jitted step's body: ``(state, batch) -> (state, metrics,
  overflow_at_min)``, ``overflow_at_min`` the internal flag
  ``StepFunction`` raises on (None without float16 loss scaling).

  With update_on="host" the device's part: ``(state, metrics, grads)``,
  the state without master and optimizer state, the gradients for the
  host's update.
  """
  pl = engine.placement
  for x in jax.tree.leaves(batch):
    checks.check_batch_dim(engine, x.shape, x.shape[0] if x.ndim else None)
  rng = jax.random.fold_in(state.rng, state.step)
  scale = state.loss_scale.scale if pl.loss_scaling else None
  grads, loss, aux = grads_lib.loss_and_grads(
      engine, state.params, state.compute_params, batch, rng, scale)
  metrics = {"loss": loss}
  if engine.has_aux:
    metrics["aux"] = aux
  if engine._host is not None:
    # The rest is the host's program (zero_jax.host_update,
    # StepFunction._host_step): the gradients leave as the reduction made
    # them.
    return (TrainState(step=state.step + 1, params=None, opt_state=None,
                       rng=state.rng), metrics, grads)
  prepared = update.prepare(engine, grads, state.step, state.loss_scale,
                            pl.grads_on_host)
  metrics.update(prepared.metrics)
  shards = (engine.param_plan.shardings if pl.grads_sharded else
            engine._device_params)
  if engine._streamer is not None:
    master, opt_state, device_master = update.streamed_update(
        engine, state, prepared.grads, shards, prepared.finite,
        prepared.grad_fn)
  else:
    master, opt_state = update.whole_update(
        engine.tx, state.params, state.opt_state, prepared.grads, shards,
        engine._device_opt, prepared.finite)
    device_master = master
  compute_params = None
  # The compute copy is refreshed from the new master, on the device.
  if pl.compute_copy == "replicated":
    compute_params = update.gather_replicated(engine.param_plan,
                                              device_master, pl.compute_dtype)
  elif pl.compute_copy == "sharded":
    compute_params = compute_copy(pl, device_master)
  elif pl.master_regathered:
    master = update.gather_replicated(engine.param_plan, device_master)
  lr = update.injected_learning_rate(opt_state)
  if engine.lr_schedule is None and lr is not None:
    # (Offloaded: the scalar comes up from host memory with the metrics.)
    metrics["learning_rate"] = jax.device_put(
        lr, on_device(engine.state_shardings.step))
  new_state = TrainState(step=state.step + 1, params=master,
                         opt_state=opt_state, rng=state.rng,
                         compute_params=compute_params,
                         loss_scale=prepared.loss_scale)
  return new_state, metrics, prepared.overflow_at_min
