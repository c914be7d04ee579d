"""The engine: ZeRO train state and one jitted, donating train step."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zero_jax import (_compat, collectives, distributed, host_update, layers,
                      loss_scale as _ls, stream)
from zero_jax.config import ZeroConfig
from zero_jax.mesh import DATA, REPLICA, batch_axes, layout_mesh
from zero_jax.placement import Placement
from zero_jax.plan import LeafPlan, Plan, path_str


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  """Everything that persists between steps; every leaf has a fixed layout.

  Attributes:
    step: number of steps taken (int32 scalar, replicated).
    params: fp32 master parameters, in the structure given to
      ``Engine.init``. Stage 0: replicated. Stage 3: sharded. Stages 1-2 with
      fp32 compute: replicated, because the replicated compute copy *is* the
      master copy; the update slices each device's shard out of it, so no
      second (sharded) copy is stored. Stages 1-2 with a ``compute_dtype``:
      sharded.
    opt_state: optimizer state, every leaf laid out by its shape (sharded at
      stages 1-3, replicated at stage 0).
    rng: base PRNG key (replicated); step keys are derived from it.
    compute_params: the compute-dtype copy of ``params`` that forward
      reads, where it is a separate copy (else None): at stages 1-2 with a
      ``compute_dtype``, replicated and refreshed by an all-gather after
      every update; at stage 3 with a ``compute_dtype`` and
      ``offload_optimizer``, sharded like ``params`` (which are then in host
      memory) and refreshed by a cast.
    loss_scale: the ``LossScaleState``: with float16 compute, the loss
      scale and its counters; in fp32 and bf16 with ``skip_nonfinite`` (the
      default), only its ``skipped`` count changes (the scale stays 1);
      None with neither.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array
  compute_params: Any = None
  loss_scale: _ls.LossScaleState | None = None


def _on_host(shardings: Any) -> Any:
  """The same shardings in pinned host memory."""
  return jax.tree.map(lambda sh: sh.with_memory_kind("pinned_host"),
                      shardings)


def _on_device(shardings: Any) -> Any:
  """The same shardings in device memory (named, so that a transfer from
  the host is explicit)."""
  return jax.tree.map(lambda sh: sh.with_memory_kind("device"), shardings)


class _StepFunction:
  """``engine.step``: the jitted train step plus batch placement.

  ``state, metrics = engine.step(state, batch)``. ``batch`` is a pytree of
  arrays whose leading dimension is the global batch (divisible by the number
  of devices); host (numpy) leaves are placed on the mesh first (in
  multi-process runs each process passes its own slice of the global batch).
  ``state`` is donated. ``metrics`` holds ``"loss"`` (the mean over the global
  batch), ``"grad_norm"`` (the global gradient norm over the whole model,
  before clipping), ``"learning_rate"`` when the engine was given
  ``lr_schedule``, with float16 loss scaling ``"loss_scale"`` (the scale
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
  ``engine.step.jitted`` is the raw ``jax.jit`` function. (With
  ``update_on="host"`` that is the device's program: it takes the state
  without ``params`` and ``opt_state``, and returns the gradients for the
  host's update beside the state and metrics.)
  """

  def __init__(self, engine: "Engine"):
    self._engine = engine
    self._at_min = None  # the previous step's overflow-at-minimum flag
    self._skipped = []  # skip flags (non-finite norm) not yet read
    self._skips = 0  # skipped steps in a row, up to the previous one
    self._returned = None  # the state the previous step returned

  @property
  def jitted(self):
    if self._engine._jitted is None:
      raise RuntimeError("call engine.init(params) before engine.step: the "
                         "step is built for the layout of those params")
    return self._engine._jitted

  def __call__(self, state: TrainState, batch: Any):
    jitted = self.jitted
    self.check()
    engine = self._engine
    if state is not self._returned:
      # (The state the last step returned is known good: skip the walk.)
      engine._check_state(state)
    engine._check_batch(batch)
    batch = engine.shard_batch(batch)
    if engine._host is None:
      state, metrics = jitted(state, batch)
    else:
      state, metrics = engine._host_step(state, batch)
    self._at_min = metrics.get("overflow_at_min_scale")
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
    jitted = self.jitted
    if self._engine._host is not None:
      state = _device_part(state)
    return jitted.lower(state, self._engine.shard_batch(batch))


_CONVERT = ("Convert a state between device counts, stages, offload "
            "settings and compute dtypes by saving it with zj.Checkpointer "
            "and restoring it into this engine (Checkpointer.restore(engine, "
            "params)).")


def _as_arrays(params: Any) -> Any:
  """Python and numpy scalars among the parameters as float32 arrays (a
  Python float is a valid scalar parameter)."""
  return jax.tree.map(
      lambda x: np.asarray(x, np.float32)
      if isinstance(x, (float, np.floating)) else x, params)


def _describe_value(x: Any) -> str:
  if hasattr(x, "dtype") and hasattr(x, "shape"):
    return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"
  return type(x).__name__


def _device_part(state: TrainState) -> TrainState:
  """What the device's program reads with update_on="host"."""
  return dataclasses.replace(state, params=None, opt_state=None)


class Engine:
  """Trains ``loss_fn`` with ``tx`` under ZeRO on ``mesh``.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with
      ``has_aux=True``; or ``loss_fn(params, batch, rng)`` with
      ``with_rng=True``), the *mean* loss over the examples it is given. It
      runs on each device's slice of the global batch with the full
      parameters, in the structure given to ``init``.
    tx: any optax transformation. The update runs on the sharded arrays as
      ordinary jit code, so global operations (norms, factored statistics)
      are exact.
    config: the ZeRO config.
    mesh: a mesh from ``make_mesh``: a ``data`` axis (state is sharded over
      it), optionally inside a ``replica`` axis (state replicated across it,
      gradient shards all-reduced across it).
    has_aux: ``loss_fn`` returns ``(loss, aux)``; aux (a pytree of arrays)
      is averaged over devices into the step's metrics under ``"aux"``.
    with_rng: ``loss_fn`` takes a third argument, a PRNG key that differs on
      every step, micro-batch and device: use it for dropout.
    lr_schedule: the optax schedule ``tx`` uses, if any: the step's
      learning rate is then reported as the ``learning_rate`` metric (taken
      at the count of updates applied, as optax does: skipped steps do not
      advance it).

  Raises:
    ValueError: the config's batch sizes contradict each other on this
      mesh (see ``ZeroConfig.batch_sizes``).
  """

  def __init__(self, loss_fn: Callable[..., Any],
               tx: optax.GradientTransformation, config: ZeroConfig,
               mesh: Mesh, *, has_aux: bool = False, with_rng: bool = False,
               lr_schedule: Callable[[jax.Array], jax.Array] | None = None):
    if DATA not in mesh.axis_names:
      raise ValueError(f"mesh must have a {DATA!r} axis (use "
                       f"zero_jax.make_mesh()); got axes {mesh.axis_names}")
    self.loss_fn = loss_fn
    self.tx = tx
    self.config = config
    self.mesh = mesh
    self.has_aux = has_aux
    self.with_rng = with_rng
    self.n = mesh.shape[DATA]
    self.replica = dict(mesh.shape).get(REPLICA, 1)
    self.axes = batch_axes(mesh)
    self.num_devices = self.n * self.replica
    self.lr_schedule = lr_schedule
    (self.train_batch_size, self.micro_batch_size,
     self.grad_accum_steps) = config.batch_sizes(self.num_devices)
    # Where master, moments, gradients and the compute copy live, and where
    # the update runs: decided once (zero_jax.placement).
    self.placement = Placement.of(config, self.grad_accum_steps)
    if self.placement.update == "host" and jax.process_count() > 1:
      raise ValueError(
          "ZeroConfig(update_on='host') updates on this process's CPU "
          "devices and supports single-process runs; with "
          f"{jax.process_count()} processes use update_on='device' (the "
          "offloaded state is then streamed through the device)")
    self._jitted = None
    self._host = None
    # delay_update: (the master the last step returned, its compute copy
    # still on the host's CPU devices), for the step after next.
    self._pending = None
    self.step = _StepFunction(self)
    self.param_plan: Plan | None = None
    self.opt_plan: Plan | None = None

  # ---------------------------------------------------------------- layout

  def _sharding(self, spec: P) -> NamedSharding:
    return NamedSharding(layout_mesh(self.mesh), spec)

  @property
  def batch_sharding(self) -> NamedSharding:
    """How ``step`` lays out a batch: leading dimension split over the
    mesh's batch axes."""
    return self._sharding(self._batch_spec)

  @property
  def _batch_spec(self) -> P:
    return P(self.axes if len(self.axes) > 1 else DATA)

  def _build(self, params: Any) -> None:
    pl = self.placement
    cfg = self.config
    self._treedef = jax.tree.structure(params)
    self._dtypes = [jnp.dtype(x.dtype) for x in jax.tree.leaves(params)]
    for (path, x) in jax.tree_util.tree_flatten_with_path(params)[0]:
      if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"parameter {path_str(path)!r} has dtype {x.dtype}; pass only "
            "trainable floating-point leaves (for Flax NNX: "
            "nnx.split(model, nnx.Param)).")
    master = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32),
                          params)
    self.param_plan = Plan(master, self.mesh, cfg.stage,
                           cfg.min_shard_elements)
    opt_shapes = jax.eval_shape(self.tx.init, master)
    self.opt_plan = Plan(opt_shapes, self.mesh, cfg.stage,
                         cfg.min_shard_elements)
    replicated_tree = jax.tree.map(lambda _: self._sharding(P()), master)
    param_shardings = (self.param_plan.shardings if pl.master_sharded else
                       replicated_tree)
    # Where each part of the state lives in device memory (for the update).
    self._device_params = param_shardings
    self._device_opt = self.opt_plan.shardings
    replicated = self._sharding(P())
    opt_shardings = self.opt_plan.shardings
    if pl.opt_on_host:
      opt_shardings = _on_host(opt_shardings)
    if pl.master_on_host:
      param_shardings = _on_host(param_shardings)
    compute_shardings = {"replicated": replicated_tree,
                         "sharded": self.param_plan.shardings,
                         None: None}[pl.compute_copy]
    self._host = self._pending = None
    if pl.update == "host":
      # ZeRO-Offload's split: master and optimizer state on the host's CPU
      # devices, updated there by a program of their own.
      self._host = host_update.HostUpdate(
          self.tx, master, host_update.host_devices(self.mesh))
      if self._host.k == 1 and (os.cpu_count() or 1) > 1:
        warnings.warn(
            "update_on='host' has 1 CPU device, so the update may use one "
            f"core of {os.cpu_count()}: call jax.config.update("
            "'jax_num_cpu_devices', os.cpu_count()) before JAX starts "
            "(before anything creates an array or lists devices).",
            stacklevel=3)
      param_shardings = self._host.master_shardings
      opt_shardings = self._host.opt_shardings
      if pl.compute_memory == "pinned_host":
        compute_shardings = _on_host(compute_shardings)
    self.state_shardings = TrainState(
        step=replicated, params=param_shardings,
        opt_state=opt_shardings, rng=replicated,
        compute_params=compute_shardings,
        loss_scale=(jax.tree.map(lambda _: replicated, _ls.init(cfg))
                    if pl.counts_skips else None))
    # The state's shapes and dtypes, for checking what step is given.
    self._shapes = jax.eval_shape(self._make_state, master)
    # Offloaded state with the update on the device: streamed slice by
    # slice (zero_jax.stream), never copied to the device whole.
    self._streamer = None
    if pl.update == "streamed":
      leaves = lambda plan: jax.tree.leaves(
          plan.leaves, is_leaf=lambda x: isinstance(x, LeafPlan))
      self._streamer = stream.Streamer(self.tx, master,
                                       leaves(self.param_plan),
                                       leaves(self.opt_plan), self.n,
                                       stream.SLICE_BYTES)
    if self._host is None:
      self._jitted = jax.jit(self._train_step, donate_argnums=0,
                             out_shardings=(self.state_shardings, replicated))
    else:
      # The device's program: gradients out for the host's update (in host
      # memory where backward sends them there). Nothing is donated: no
      # output takes an input's place; the step deletes the old compute
      # copy once this is dispatched.
      grads = replicated_tree if cfg.stage == 0 else self.param_plan.shardings
      if pl.grads_on_host:
        grads = jax.tree.map(
            lambda lp, sh: sh.with_memory_kind("pinned_host") if lp.sharded
            else sh, self.param_plan.leaves, grads,
            is_leaf=lambda x: isinstance(x, LeafPlan))
      self._jitted = jax.jit(
          self._train_step,
          out_shardings=(dataclasses.replace(
              _device_part(self.state_shardings), compute_params=None,
              loss_scale=None), replicated, grads))

  # ------------------------------------------------------------------ API

  def init(self, params: Any) -> TrainState:
    """Copies ``params`` onto the mesh in ZeRO layout and builds the state.

    Args:
      params: any pytree of floating arrays (a dict, Flax Linen params, a
        Flax NNX ``nnx.State``). It is copied: the caller's arrays stay valid
        and unchanged however many (donating) steps follow.

    Returns:
      The initial ``TrainState``.
    """
    params = _as_arrays(params)
    self._build(params)
    if self._host is not None:
      return self._host_state(params)
    make_state, args = self._initializer(params)
    # Always a copy (may_alias=False): later steps donate the state, and that
    # must never invalidate the caller's arrays.
    placed = jax.device_put(params, jax.tree.map(lambda a: a.sharding,
                                                 args[0]), may_alias=False)
    # Buffers the streamed init writes into, made where they live: zeros in
    # host memory come from numpy, shard by shard, never through a device.
    zeros = lambda a: None if a is None else jax.make_array_from_callback(
        a.shape, a.sharding, lambda idx: np.zeros(
            a.sharding.shard_shape(a.shape), a.dtype))
    buffers = jax.tree.map(zeros, args[1:], is_leaf=lambda a: a is None)
    return make_state(placed, *buffers)

  def _initializer(self, params: Any) -> tuple[Callable[..., TrainState],
                                               tuple]:
    """The jitted function ``init`` runs, and its arguments as
    ``jax.ShapeDtypeStruct`` trees with shardings: the placed parameters,
    then (streamed init) host buffers for the master and optimizer state
    (None where the buffer is made on the device or not needed)."""
    pl = self.placement
    sh = self.state_shardings
    sds = lambda x, s, dt=None: jax.ShapeDtypeStruct(x.shape, dt or x.dtype,
                                                     sharding=s)
    if self._streamer is not None:
      host = lambda s: s.memory_kind == "pinned_host"
      where = (_on_host(self.param_plan.shardings) if pl.master_on_host
               else self.param_plan.shardings)
      placed = jax.tree.map(sds, params, where)
      master = [sds(x, s, jnp.float32) if host(s) and x.dtype != jnp.float32
                else None for x, s in zip(jax.tree.leaves(params),
                                          jax.tree.leaves(where))]
      opt = jax.eval_shape(self.tx.init, jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), params))
      opt = [sds(x, s) if host(s) else None for x, s in
             zip(jax.tree.leaves(opt), jax.tree.leaves(sh.opt_state))]
      # (The placed copy is ours; it becomes the master where the layouts
      # agree: stage 3, or stages 1-2 with a compute copy.)
      donate = (0, 1, 2) if pl.master_sharded else (1, 2)
      return jax.jit(self._streamed_make_state, out_shardings=sh,
                     donate_argnums=donate), (placed, master, opt)
    if pl.master_on_host:
      # Placed in host memory first, so that no device ever holds a full
      # copy; the state is then built from device copies of the shards and
      # written back to the host by out_shardings. (Not compute_on: XLA
      # aborts compiling a compute_on'd init for GPUs.)
      on_device = _on_device(self._device_params)
      return jax.jit(lambda p: self._make_state(jax.device_put(p, on_device)),
                     out_shardings=sh), (jax.tree.map(sds, params, sh.params),)
    # Straight into the final layout: no device ever holds a full copy of a
    # sharded leaf.
    return (jax.jit(self._make_state, out_shardings=sh),
            (jax.tree.map(sds, params, self._device_params),))

  def _host_state(self, params: Any) -> TrainState:
    """The initial state with update_on="host": master and optimizer state
    built on the host's CPU devices, the compute copy sent to the device."""
    pl = self.placement
    host = self._host
    master = jax.jit(lambda p: jax.tree.map(
        lambda x: x.astype(jnp.float32), p),
                     out_shardings=host.master_shardings)(host.put(params))
    rest = jax.jit(lambda: TrainState(
        step=jnp.zeros((), jnp.int32), params=None, opt_state=None,
        rng=jax.random.PRNGKey(self.config.seed),
        loss_scale=_ls.init(self.config) if pl.counts_skips else None),
                   out_shardings=dataclasses.replace(
                       _device_part(self.state_shardings),
                       compute_params=None))()
    return dataclasses.replace(rest, params=master,
                               opt_state=host.init(master),
                               compute_params=self._host_copy(master))

  def _host_copy(self, master: Any) -> Any:
    """The compute copy, cast from the host's master, on the device."""
    copy = jax.jit(lambda m: jax.tree.map(
        lambda x: x.astype(self.placement.copy_dtype), m),
                   out_shardings=self._host.master_shardings)(master)
    return jax.device_put(copy, self.state_shardings.compute_params)

  def _host_step(self, state: TrainState, batch: Any):
    """``step`` with update_on="host": the device's program, then the
    host's update (dispatched asynchronously, like any jitted call)."""
    new, metrics, grads = self._jitted(_device_part(state), batch)
    master, opt_state, copy, (loss_scale, more) = self._host.update(
        grads, state.params, state.opt_state,
        {"step": state.step, "loss_scale": state.loss_scale},
        prepare=self._host_prepare, compute_dtype=self.placement.copy_dtype)
    metrics.update(more)
    if loss_scale is not None:
      loss_scale = jax.device_put(loss_scale, self.state_shardings.loss_scale)
    to_device = lambda c: jax.device_put(c,
                                         self.state_shardings.compute_params)
    if not self.config.delay_update:
      compute = to_device(copy)
    else:
      # The next step reads the copy this step's update started from (made
      # by the last step's update, sent up now), not the one being made: the
      # device need not wait for the host, whose update of this step runs
      # while the device computes the next. (Only for the state the last
      # step returned; after init or a restore the state's own copy.)
      pending, self._pending = self._pending, (master, copy)
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
        compute_params=compute), metrics

  def _streamed_make_state(self, params: Any, master: list,
                           opt: list) -> TrainState:
    """The initial state, built slice by slice (``zero_jax.stream``)."""
    pl = self.placement
    cd = pl.compute_dtype if pl.compute_copy else None
    flat = jax.tree.leaves(params)
    shards = jax.tree.leaves(self.param_plan.shardings)
    device_zeros = lambda shape, dtype, s: jax.lax.with_sharding_constraint(
        jnp.zeros(shape, dtype), s)
    master = [p if p.dtype == jnp.float32 else
              b if b is not None else device_zeros(p.shape, jnp.float32, s)
              for p, b, s in zip(flat, master, shards)]
    opt_shapes = jax.tree.leaves(jax.eval_shape(
        self.tx.init, jax.tree.unflatten(jax.tree.structure(params), master)))
    opt = [b if b is not None else device_zeros(x.shape, x.dtype, s)
           for b, x, s in zip(opt, opt_shapes,
                              jax.tree.leaves(self._device_opt))]
    compute = (None if cd is None else
               [device_zeros(p.shape, cd, s) for p, s in zip(flat, shards)])
    master, opt_state, compute = self._streamer.init(
        flat, master, opt, master_on_host=pl.master_on_host,
        opt_on_host=pl.opt_on_host,
        compute_dtype=cd, compute=compute)
    compute_params = None
    if compute is not None:
      compute_params = jax.tree.unflatten(jax.tree.structure(master), compute)
      if pl.compute_copy == "replicated":
        compute_params = self._gather_replicated(compute_params)
    elif self.config.stage in (1, 2):
      master = self._gather_replicated(master)  # fp32: the master replicated
    return TrainState(step=jnp.zeros((), jnp.int32), params=master,
                      opt_state=opt_state,
                      rng=jax.random.PRNGKey(self.config.seed),
                      compute_params=compute_params,
                      loss_scale=(_ls.init(self.config) if pl.counts_skips
                                  else None))

  def _make_state(self, params: Any) -> TrainState:
    pl = self.placement
    master = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=master,
                      opt_state=self.tx.init(master),
                      rng=jax.random.PRNGKey(self.config.seed),
                      compute_params=self._compute_copy(master),
                      loss_scale=(_ls.init(self.config) if pl.counts_skips
                                  else None))

  def _compute_copy(self, master: Any) -> Any:
    """The compute-dtype copy forward reads, where it is a separate copy."""
    pl = self.placement
    if not pl.compute_copy:
      return None
    return jax.tree.map(lambda x: x.astype(pl.copy_dtype), master)

  def abstract_state(self, params: Any) -> TrainState:
    """The ``TrainState`` that ``init(params)`` would build, as
    ``jax.ShapeDtypeStruct`` leaves carrying their shardings.

    Args:
      params: the parameters, or only their shapes and dtypes (e.g.
        ``jax.eval_shape(model.init, ...)``): nothing is computed or placed.

    Returns:
      The abstract state: the target to restore a checkpoint into.
    """
    params = _as_arrays(params)
    self._build(params)
    shapes = jax.eval_shape(self._make_state, params)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        shapes, self.state_shardings)

  def _complete(self, state: TrainState) -> TrainState:
    """Fills in what a checkpoint does not store: the compute copy (a cast
    of the master) and, for float16, a loss scale if the checkpoint had
    none."""
    pl = self.placement
    sh = self.state_shardings
    compute = loss_scale = None
    if self._host is not None:
      compute = self._host_copy(state.params)
    elif sh.compute_params is not None:
      def cast(master):
        # (An offloaded master is cast on the device, shard by shard.)
        return self._compute_copy(
            jax.device_put(master, _on_device(self.param_plan.shardings)))
      compute = jax.jit(cast, out_shardings=sh.compute_params)(state.params)
    if pl.counts_skips:
      loss_scale = state.loss_scale
      if loss_scale is None:
        loss_scale = jax.jit(lambda: _ls.init(self.config),
                             out_shardings=sh.loss_scale)()
    return dataclasses.replace(state, compute_params=compute,
                               loss_scale=loss_scale)

  def gather_params(self, state: TrainState) -> Any:
    """The full parameters, unsharded, in the tree and dtypes given to init.

    Returns replicated arrays (every device holds the whole value).
    """
    dtypes = self._dtypes
    treedef = self._treedef

    def gather(p):
      leaves = [x.astype(dt) for x, dt in zip(jax.tree.leaves(p), dtypes)]
      return treedef.unflatten(leaves)

    out = jax.tree.map(lambda _: self._sharding(P()), state.params)
    # (From host memory or the host's CPU devices, if offloaded.)
    params = jax.device_put(state.params, _on_device(self._device_params))
    return jax.jit(gather, out_shardings=out)(params)

  def shard_batch(self, batch: Any) -> Any:
    """Places a batch on the mesh, split over ``data`` on the leading dim.

    ``jax.Array`` leaves are taken as global arrays. Host (numpy) leaves are
    this process's slice of the global batch (in a single-process run: the
    whole batch).
    """
    nproc = jax.process_count()

    def place(x):
      if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return x  # (shapes: for lowering)
      x = np.asarray(x)
      self._check_batch_dim(x.shape, nproc * x.shape[0] if x.ndim else None)
      return jax.make_array_from_process_local_data(self.batch_sharding, x)

    return jax.tree.map(place, batch)

  def describe(self) -> str:
    """A table of every parameter: shape, and where it lives per device."""
    pl = self.placement
    if self.param_plan is None:
      raise RuntimeError("call engine.init(params) before engine.describe()")
    n = self.n
    where_ = f"{n} device(s) on '{DATA}'"
    if self.replica > 1:
      where_ += f", replicated over {self.replica} '{REPLICA}' groups"
    dtype = self.config.compute_dtype or "float32"
    lines = [f"ZeRO stage {self.config.stage} over {where_}; compute in "
             f"{dtype}, master and optimizer state in float32",
             f"{'parameter':<40} {'shape':<18} layout"]
    replicated = []
    for path, lp in self.param_plan.rows():
      if lp.sharded:
        where = (f"sharded dim {lp.dim} -> {lp.local_shape(n)} per device")
      else:
        where = f"replicated ({lp.reason})"
        replicated.append(path)
      lines.append(f"{path:<40} {str(lp.shape):<18} {where}")
    n_rep = sum(1 for _, lp in self.opt_plan.rows() if not lp.sharded)
    lines.append(f"{len(replicated)} of {len(self.param_plan.rows())} "
                 f"parameter leaves replicated: {replicated or 'none'}")
    lines.append(f"optimizer state: {len(self.opt_plan.rows())} leaves, "
                 f"{n_rep} replicated (scalars, small or indivisible)")
    lines.extend(pl.describe())
    if self._streamer is not None:
      lines.extend(self._streamer.describe())
    if self._host is not None:
      lines.append(self._host.describe())
      if self.config.delay_update:
        lines.append("delay_update: each step reads the parameters from "
                     "before the previous step's update (DeepSpeed's "
                     "delayed parameter update), so the host's update "
                     "overlaps the next step")
    cfg = self.config
    if pl.loss_scaling:
      lines.append("float16 loss scaling: " + (
          f"static {cfg.loss_scale}" if cfg.loss_scale else
          f"dynamic from 2**{cfg.initial_scale_power}, window "
          f"{cfg.loss_scale_window}, hysteresis {cfg.hysteresis}, min "
          f"{cfg.min_loss_scale}"))
    if self.grad_accum_steps > 1 or cfg.clip_grad_norm is not None:
      lines.append(f"{self.grad_accum_steps} micro-batch(es) per step; "
                   f"clip to global norm {cfg.clip_grad_norm}")
    return "\n".join(lines)

  def replicated_params(self) -> list[str]:
    """Paths of parameter leaves that are not sharded."""
    if self.param_plan is None:
      raise RuntimeError("call engine.init(params) before "
                         "engine.replicated_params()")
    return [p for p, lp in self.param_plan.rows() if not lp.sharded]

  # ----------------------------------------------------------------- step

  def _check_state(self, state: Any) -> None:
    """Raises, naming the difference and the fix, unless ``state`` is a
    live ``TrainState`` of this engine's layout."""
    if not isinstance(state, TrainState):
      raise TypeError(
          "engine.step takes the TrainState of engine.init, of the previous "
          "step or of Checkpointer.restore; got "
          f"{type(state).__name__}")
    for part in ("params", "opt_state", "compute_params", "loss_scale",
                 "step", "rng"):
      got, want = getattr(state, part), getattr(self._shapes, part)
      shardings = getattr(self.state_shardings, part)
      got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(got)
      if got_tree != jax.tree.structure(want):
        raise ValueError(
            f"state.{part} does not have this engine's tree (it has "
            f"{len(got_leaves)} leaves, this engine's has "
            f"{len(jax.tree.leaves(want))}): the state comes from an engine "
            "with another model, optimizer, compute_dtype or loss scaling. "
            + _CONVERT + " A state of another model or optimizer cannot be "
            "converted.")
      for (path, x), w, sh in zip(got_leaves, jax.tree.leaves(want),
                                  jax.tree.leaves(shardings)):
        where = f"state.{part}{jax.tree_util.keystr(path)}"
        if not isinstance(x, jax.Array):
          raise TypeError(f"{where} is a {type(x).__name__}, not a jax.Array:"
                          " pass the state engine.init or engine.step "
                          "returned")
        if x.is_deleted():
          raise ValueError(
              f"{where} was deleted: this TrainState was donated to an "
              "earlier engine.step, which returned the state to use "
              "instead (state, metrics = engine.step(state, batch)).")
        if x.shape != w.shape or x.dtype != w.dtype:
          raise ValueError(
              f"{where} is {_describe_value(x)}, this engine's is "
              f"{_describe_value(w)}: the state comes from another model or "
              "engine. " + _CONVERT)
        if (not x.sharding.is_equivalent_to(sh, x.ndim) or
            (x.sharding.memory_kind or "device") !=
            (sh.memory_kind or "device")):
          raise ValueError(
              f"{where} is laid out on {len(x.sharding.device_set)} "
              f"device(s) ({x.sharding}); this engine lays it out on "
              f"{len(sh.device_set)} ({sh}): the state comes from an "
              "engine with another mesh, stage or offload setting. "
              + _CONVERT)

  def _check_batch(self, batch: Any) -> None:
    """Raises unless every batch leaf has one and the same leading
    (example) dimension, not zero."""
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
      raise ValueError("the batch holds no arrays: pass a pytree of arrays "
                       "whose leading dimension is the examples")
    sizes = {}
    for path, x in leaves:
      shape = np.shape(x)
      if not shape:
        raise ValueError(
            f"batch leaf {jax.tree_util.keystr(path) or 'batch'} is a "
            "scalar; batch leaves need a leading batch dimension")
      sizes[jax.tree_util.keystr(path) or "batch"] = shape[0]
    if len(set(sizes.values())) > 1:
      raise ValueError(
          "batch leaves have different leading (example) dimensions: "
          + ", ".join(f"{k}: {v}" for k, v in sizes.items())
          + "; every leaf must hold the same examples, one row each")
    if not next(iter(sizes.values())):
      raise ValueError("the batch has 0 examples; pass at least one example "
                       "per device")

  def _split_loss(self, out: Any) -> tuple[Any, Any]:
    """``(loss, aux)`` from what ``loss_fn`` returned, or a TypeError that
    names what it returned and ``has_aux``."""
    pair = isinstance(out, (tuple, list)) and len(out) == 2
    if self.has_aux and not pair:
      raise TypeError(
          f"loss_fn returned {_describe_value(out)}, but the Engine has "
          "has_aux=True: return (loss, aux), or pass has_aux=False")
    if not self.has_aux and isinstance(out, (tuple, list)):
      raise TypeError(
          f"loss_fn returned a {type(out).__name__} of {len(out)}: return "
          "the scalar loss, or pass has_aux=True to return (loss, aux)")
    loss, aux = out if self.has_aux else (out, None)
    dtype = getattr(loss, "dtype", None)
    if (isinstance(loss, (bool, int)) or dtype is None or
        not jnp.issubdtype(dtype, jnp.floating) or np.shape(loss) != ()):
      raise TypeError(
          f"loss_fn must return a floating-point scalar (the mean loss over "
          f"its examples); it returned {_describe_value(loss)}"
          + ("" if self.has_aux else " (with has_aux=False)")
          + ". An integer or bool loss has no gradient: compute it in "
          "floating point from the parameters.")
    return loss, aux

  def _check_batch_dim(self, shape, global_size) -> None:
    if not shape:
      raise ValueError("batch leaves need a leading batch dimension; got a "
                       "scalar")
    if (self.train_batch_size is not None
        and global_size != self.train_batch_size):
      raise ValueError(
          f"global batch size {global_size} differs from the config's "
          f"train_batch_size {self.train_batch_size} (micro_batch_size "
          f"{self.micro_batch_size} x grad_accum_steps "
          f"{self.grad_accum_steps} x {self.num_devices} devices); pass "
          f"batches of {self.train_batch_size} examples")
    n = self.num_devices * self.grad_accum_steps
    if global_size % n:
      what = f"the {self.num_devices} devices of the mesh"
      if self.grad_accum_steps > 1:
        what += f" x {self.grad_accum_steps} micro-batches (grad_accum_steps)"
      raise ValueError(
          f"global batch size {global_size} is not divisible by {what}; use "
          f"a global batch that is a multiple of {n} (e.g. "
          f"{max(1, global_size // n) * n}).")

  def _loss_and_grads(self, params, compute_params, batch, rng, scale):
    """Per-device loss and gradients, reduced into the ZeRO layout.

    Gradients come back in float32 whatever the compute dtype, summed over
    the global batch and every micro-batch, and multiplied by ``scale`` (the
    loss scale, or None).
    """
    pl = self.placement
    cfg = self.config
    stage, axes = cfg.stage, self.axes
    cd, rd = pl.compute_dtype, pl.reduce_dtype
    accum = self.grad_accum_steps
    plans = self.param_plan.leaves
    is_plan = lambda x: isinstance(x, LeafPlan)
    leaves = lambda t: jax.tree.leaves(t, is_leaf=is_plan)
    varying = lambda x: jax.lax.pcast(x, axes, to="varying")
    cast = lambda t: t if cd is None else jax.tree.map(
        lambda x: x.astype(cd), t)
    record = lambda recorded: layers._recording(recorded, cfg.remat,
                                                cfg.remat_names)
    # Scaling by 1/(devices * micro-batches) makes the summed gradient the
    # mean over the global batch.
    divisor = self.num_devices * accum
    structure = jax.tree.structure(params if params is not None else
                                   compute_params)
    unflatten = lambda full: jax.tree.unflatten(structure, full)

    # Stage 3 gathers from something other than the fp32 master shards when
    # the master is offloaded: the sharded compute copy, or (offload_params)
    # the master in host memory, copied to the device layer by layer.
    gather_from = pl.gather_from in ("compute", "host_master", "host_compute")
    to_device = pl.gather_from in ("host_master", "host_compute")
    # Gradients go to the host for the leaves the update streams slice by
    # slice; small (whole) leaves gain nothing from the round trip.
    # (With update_on="host", every sharded leaf's.)
    grads_to_host = [pl.grads_on_host and (self._streamer is None or
                                           l in self._streamer.cuts)
                     for l in range(len(leaves(plans)))]
    on_device = ((lambda x: jax.device_put(x, jax.memory.Space.Device))
                 if pl.master_on_host else (lambda x: x))

    def local(params, compute_params, batch, rng, scale):
      # Forward reads the compute copy wherever there is one.
      source = compute_params if pl.compute_copy else params

      def loss_of(full, batch, key):
        args = (full, batch, key) if self.with_rng else (full, batch)
        loss, aux = self._split_loss(self.loss_fn(*args))
        scaled = loss / divisor
        if scale is not None:
          scaled = scaled * scale
        return scaled, (loss, aux)

      # What we differentiate with respect to. Each gradient comes back with
      # its argument's layout, so the arguments decide where reduction
      # happens. Replicated leaves are marked device-varying here, outside
      # the gradient, so their gradients stay local and are all-reduced once
      # after the last micro-batch.
      if stage in (0, 1):
        # Stages 0-1: local full gradients, reduced at the end.
        wrt = jax.tree.map(varying, source)
      elif stage == 2 or gather_from:
        # Zero-valued stand-ins of each shard: each leaf's gradient is
        # reduce-scattered as backward produces it. (In host memory where
        # the gradients go there: a cotangent lives where its primal does.
        # Forward never reads them.)
        def stand_in(lp, to_host):
          z = jnp.zeros(lp.local_shape(self.n), jnp.float32)
          if to_host:
            z = jax.device_put(z, jax.memory.Space.Host)
          return jax.lax.pcast(z, DATA, to="varying")

        # (Replicated leaves are differentiated in float32 as themselves:
        # the master, or with update_on="host", which leaves the master on
        # the host, the compute copy widened.)
        whole = leaves(params if params is not None else source)
        wrt = unflatten([
            stand_in(lp, to_host) if lp.sharded else
            varying(on_device(p).astype(jnp.float32))
            for lp, p, to_host in zip(leaves(plans), whole, grads_to_host)])
      else:
        # Stage 3: the shards themselves; gather at use, and the gather's
        # transpose reduce-scatters.
        wrt = jax.tree.map(lambda lp, p: p if lp.sharded else varying(p),
                           plans, params, is_leaf=is_plan)

      def grads_of(batch, key):
        if stage in (0, 1):
          fn = lambda x: loss_of(cast(x), batch, key)
          with record({}):
            g, (loss, aux) = jax.grad(fn, has_aux=True)(wrt)
          return g, loss, aux

        def loss_of_wrt(wrt):
          full, recorded = [], {}
          for lp, w, src, to_host in zip(leaves(plans), leaves(wrt),
                                         leaves(source), grads_to_host):
            if not lp.sharded:
              f = w if cd is None else w.astype(cd)
            elif stage == 2:
              src = varying(src)
              f = collectives.use_with_scattered_grad(lp, w, src, rd)
              recorded[id(f)] = layers._Recorded("scatter", lp, w, src, cd,
                                                 rd)
            elif gather_from:
              f = collectives.gather_from(lp, w, src, cd, rd, to_device,
                                          to_host)
              recorded[id(f)] = layers._Recorded("gather_from", lp, w, src,
                                                 cd, rd, to_device, to_host)
            else:
              f = collectives.gather_leaf(lp, w, cd, rd)
              recorded[id(f)] = layers._Recorded("gather", lp, w, None, cd,
                                                 rd)
            full.append(f)
          with record(recorded):
            return loss_of(unflatten(full), batch, key)

        g, (loss, aux) = jax.grad(loss_of_wrt, has_aux=True)(wrt)
        return g, loss, aux

      key = jax.random.fold_in(rng, jax.lax.axis_index(axes))
      if accum == 1:
        g, loss, aux = grads_of(batch, key)
      else:
        # A scan over micro-batches. The accumulator has the layout of the
        # gradients: a full local copy at stages 0-1, shards at stages 2-3.
        micro = jax.tree.map(
            lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]),
            batch)
        acc = jax.tree.map(
            lambda lp, w: (jax.lax.pcast(jnp.zeros(w.shape, jnp.float32),
                                         DATA, to="varying")
                           if stage >= 2 and lp.sharded else
                           varying(jnp.zeros(w.shape, jnp.float32))),
            plans, wrt, is_leaf=is_plan)

        def body(acc, xs):
          b, i = xs
          g, loss, aux = grads_of(b, jax.random.fold_in(key, i))
          acc = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), acc, g)
          return acc, (loss, aux)

        g, (losses, auxes) = jax.lax.scan(body, acc,
                                          (micro, jnp.arange(accum)))
        loss = jnp.mean(losses)
        aux = jax.tree.map(lambda a: jnp.mean(a, axis=0), auxes)
      if stage in (0, 1):
        g = collectives.reduce_tree(plans, g, rd, jnp.float32)
      else:
        g = jax.tree.map(lambda lp, x: x if lp.sharded else
                         jax.lax.psum(x.astype(jnp.float32), axes),
                         plans, g, is_leaf=is_plan)
      loss = jax.lax.pmean(loss, axes)
      aux = jax.tree.map(lambda a: jax.lax.pmean(a, axes), aux)
      return g, loss, aux

    replicated = self.param_plan.replicated_specs
    in_params = (None if params is None else self.param_plan.specs
                 if pl.master_sharded else replicated)
    in_compute = {"replicated": replicated, "sharded": self.param_plan.specs,
                  None: None}[pl.compute_copy]
    grad_specs = replicated if stage == 0 else self.param_plan.specs
    fn = jax.shard_map(local, mesh=self.mesh,
                       in_specs=(in_params, in_compute, self._batch_spec, P(),
                                 None if scale is None else P()),
                       out_specs=(grad_specs, P(), P()))
    return fn(params, compute_params, batch, rng, scale)

  def _gather_replicated(self, tree, dtype=None):
    """Explicit all-gather of sharded leaves into replicated copies, cast to
    ``dtype`` first (so a bf16 copy moves half the bytes)."""
    plans = self.param_plan.leaves

    def gather(lp, x):
      x = x if dtype is None else x.astype(dtype)
      return (jax.lax.all_gather(x, DATA, axis=lp.dim, tiled=True)
              if lp.sharded else x)

    fn = jax.shard_map(
        lambda t: jax.tree.map(gather, plans, t,
                               is_leaf=lambda x: isinstance(x, LeafPlan)),
        mesh=self.mesh, in_specs=(self.param_plan.specs,),
        out_specs=self.param_plan.replicated_specs,
        # all_gather's result is typed device-varying, but it is identical on
        # every device by construction.
        check_vma=False)
    return fn(tree)

  def _streamed_update(self, state, grads, shards, finite, grad_fn):
    """The update with offloaded state, slice by slice (zero_jax.stream).

    Returns the new master and optimizer state where they live, and the
    new master (cast to the compute dtype where forward reads a separate
    copy) in device memory, built slice by slice.
    """
    pl = self.placement
    cd = pl.compute_dtype if pl.compute_copy else None
    master = state.params
    if not pl.master_on_host:
      # (Stages 1-2 with fp32 compute: slicing the replicated master to its
      # shard is local, no communication.)
      master = jax.device_put(master, shards)
    compute = None
    if pl.compute_copy == "sharded":
      compute = jax.tree.leaves(state.compute_params)
    elif cd is not None:
      compute = [jax.lax.with_sharding_constraint(jnp.zeros(x.shape, cd), sh)
                 for x, sh in zip(jax.tree.leaves(master),
                                  jax.tree.leaves(shards))]
    master, opt_state, compute = self._streamer.update(
        grads, state.opt_state, master, finite=finite,
        master_on_host=pl.master_on_host,
        opt_on_host=pl.opt_on_host,
        compute_dtype=cd, compute=compute, grad_fn=grad_fn)
    device_master = (master if cd is None and not pl.master_on_host
                     else None)
    if compute is not None:
      device_master = jax.tree.unflatten(jax.tree.structure(master), compute)
    return master, opt_state, device_master

  def _whole_update(self, state, grads, shards, finite):
    """The update on whole (sharded) arrays in device memory."""
    # (Stages 1-2 with fp32 compute: slicing the replicated master to its
    # shard is local, no communication.)
    master = jax.device_put(state.params, _on_device(shards))
    opt_state = jax.device_put(state.opt_state, _on_device(self._device_opt))

    def apply(master, opt_state):
      updates, opt_state = self.tx.update(grads, opt_state, master)
      return optax.apply_updates(master, updates), opt_state

    new = apply(master, opt_state)
    if finite is None:
      return new
    # A select fused into each leaf's update loop, not a lax.cond: the cond's
    # two branches keep the old and the new state apart, which cost a 1.3B
    # GPT's H100 step 9 GiB of temp (37.0 against 27.8 GiB).
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new,
                        (master, opt_state))

  def _prepare(self, grads, step, loss_scale, streamed: bool = False):
    """From summed gradients to the ones to apply: unscaled (float16),
    their global norm, one overflow flag, the loss scale's update, and
    clipping. The device step and the host's update (update_on="host") both
    run it.

    With ``streamed`` the gradients are in host memory: their norm and
    finiteness are read a slice at a time, and the update unscales and
    clips each slice as it reads it (through the returned ``grad_fn``).

    Returns:
      ``(grads, finite, grad_fn, loss_scale, metrics)``: ``finite`` is None
      without loss scaling.
    """
    pl = self.placement
    cfg = self.config
    scale = loss_scale.scale if pl.loss_scaling else None
    unscale = (lambda g: g) if scale is None else (lambda g: g / scale)
    if streamed:
      norm, all_finite = self._streamer.grad_stats(grads, unscale)
    else:
      grads = jax.tree.map(unscale, grads)
      # Outside shard_map the gradients are global (sharded) arrays, so the
      # norm is over the whole model, exactly; XLA inserts the reduction.
      norm = optax.tree.norm(grads)
      # One flag for the whole model: an overflow in any shard on any
      # device skips the update everywhere (jnp.all over global arrays
      # reduces across devices).
      all_finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g))
                                      for g in jax.tree.leaves(grads)]))
    clip = lambda g: g
    if cfg.clip_grad_norm is not None:
      c = cfg.clip_grad_norm
      # optax.clip_by_global_norm's formula, on the norm already computed.
      clip = lambda g: jnp.where(norm < c, g, g / norm.astype(g.dtype) * c)
    grad_fn = None
    if streamed:
      grad_fn = lambda g: clip(unscale(g))
    else:
      grads = jax.tree.map(clip, grads)
    metrics = {"grad_norm": norm}
    applied = step
    finite = None
    if not pl.loss_scaling and cfg.skip_nonfinite:
      # A NaN or inf anywhere makes the global norm non-finite: one scalar
      # check skips the update on every device.
      finite = jnp.isfinite(norm)
      skipped = jnp.logical_not(finite)
      applied = step - loss_scale.skipped
      loss_scale = dataclasses.replace(
          loss_scale, skipped=loss_scale.skipped + skipped.astype(jnp.int32))
      metrics.update(skipped=skipped, skipped_steps=loss_scale.skipped)
    if pl.loss_scaling:
      finite = all_finite
      applied = step - loss_scale.skipped
      loss_scale, at_min = _ls.update(loss_scale, finite, cfg)
      metrics.update(loss_scale=scale, skipped=jnp.logical_not(finite),
                     skipped_steps=loss_scale.skipped,
                     overflow_at_min_scale=at_min)
    if self.lr_schedule is not None:
      # The rate of this update: optax's count is the updates applied before.
      metrics["learning_rate"] = self.lr_schedule(applied)
    return grads, finite, grad_fn, loss_scale, metrics

  def _host_prepare(self, grads, extra):
    """``_prepare`` inside the host's update: ``(grads, finite, (loss
    scale, metrics))``."""
    grads, finite, _, loss_scale, metrics = self._prepare(
        grads, extra["step"], extra["loss_scale"])
    return grads, finite, (loss_scale, metrics)

  def _train_step(self, state: TrainState, batch: Any):
    pl = self.placement
    for x in jax.tree.leaves(batch):
      self._check_batch_dim(x.shape, x.shape[0] if x.ndim else None)
    rng = jax.random.fold_in(state.rng, state.step)
    scale = state.loss_scale.scale if pl.loss_scaling else None
    grads, loss, aux = self._loss_and_grads(state.params, state.compute_params,
                                            batch, rng, scale)
    metrics = {"loss": loss}
    if self.has_aux:
      metrics["aux"] = aux
    if self._host is not None:
      # The rest is the host's program (zero_jax.host_update, _host_step):
      # the gradients leave as the reduction made them.
      return (TrainState(step=state.step + 1, params=None, opt_state=None,
                         rng=state.rng), metrics, grads)
    grads, finite, grad_fn, loss_scale, more = self._prepare(
        grads, state.step, state.loss_scale, pl.grads_on_host)
    metrics.update(more)
    shards = (self._device_params if self.config.stage == 0 else
              self.param_plan.shardings)
    if self._streamer is not None:
      master, opt_state, device_master = self._streamed_update(
          state, grads, shards, finite, grad_fn)
    else:
      master, opt_state = self._whole_update(state, grads, shards, finite)
      device_master = master
    compute_params = None
    # The compute copy is refreshed from the new master, on the device.
    if pl.compute_copy == "replicated":
      compute_params = self._gather_replicated(device_master, pl.compute_dtype)
    elif pl.compute_copy == "sharded":
      compute_params = self._compute_copy(device_master)
    elif self.config.stage in (1, 2):
      master = self._gather_replicated(device_master)
    new_state = TrainState(step=state.step + 1, params=master,
                           opt_state=opt_state, rng=state.rng,
                           compute_params=compute_params,
                           loss_scale=loss_scale)
    return new_state, metrics
