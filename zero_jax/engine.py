"""The engine: lays out the ZeRO state and builds one jitted, donating
train step.

``Engine`` decides the layout (``Placement``, the ``Plan`` of every leaf,
the state's shardings) and hands the rest to small modules: ``initial``
builds the first state, ``step`` wraps the jitted step, whose body is
``grads`` (loss and reduced gradients) then ``update`` (prepare and apply
them), and ``checks`` tests what the user passes in.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zero_jax import (blocks, checks, host_update, initial, loss_scale as _ls,
                      step as step_lib, stream)
from zero_jax.config import ZeroConfig
from zero_jax.mesh import DATA, REPLICA, batch_axes, layout_mesh
from zero_jax.placement import Placement
from zero_jax.plan import Plan, flat, path_str
from zero_jax.state import TrainState, on_device, on_host

__all__ = ["Engine", "TrainState"]


def _as_arrays(params: Any) -> Any:
  """Python and numpy scalars among the parameters as float32 arrays (a
  Python float is a valid scalar parameter)."""
  return jax.tree.map(
      lambda x: np.asarray(x, np.float32)
      if isinstance(x, (float, np.floating)) else x, params)


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
    lr_schedule: deprecated (the schedule was given twice, here and to
      ``tx``): build ``tx`` with ``optax.inject_hyperparams`` instead, e.g.
      ``optax.inject_hyperparams(optax.adamw)(learning_rate=schedule)``,
      and the ``learning_rate`` metric is the rate of the last update
      applied, read from the optimizer state. (Given, it still reports
      ``lr_schedule`` at the count of updates applied.)

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
    if lr_schedule is not None:
      warnings.warn(
          "Engine(lr_schedule=...) is deprecated and goes in the next "
          "release: give the schedule once, to the optimizer, as "
          "optax.inject_hyperparams(optax.adamw)(learning_rate=schedule); "
          "the learning_rate metric is then read from its state",
          DeprecationWarning, stacklevel=2)
    self.lr_schedule = lr_schedule
    # The remat policy the step is traced with; "auto" until chosen
    # (zero_jax.auto_remat), with why in remat_reason.
    self.remat, self.remat_reason = config.remat, None
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
    # Built by init (or abstract_state) for the layout of its parameters:
    # the jitted step, the host's update (update_on="host") and the
    # streamed update's slicing (offloaded state updated on the device).
    self._jitted = None
    self._host = None
    self._streamer = None
    # delay_update: (the master the last step returned, its compute copy
    # still on the host's CPU devices), for the step after next.
    self._pending = None
    self.step = step_lib.StepFunction(self)
    self.param_plan: Plan | None = None
    self.opt_plan: Plan | None = None

  # ---------------------------------------------------------------- layout

  def _sharding(self, spec: P) -> NamedSharding:
    return NamedSharding(layout_mesh(self.mesh), spec)

  @property
  def batch_sharding(self) -> NamedSharding:
    """How ``step`` lays out a batch: leading dimension split over the
    mesh's batch axes."""
    return self._sharding(P(self.axes if len(self.axes) > 1 else DATA))

  @property
  def param_dtypes(self) -> list[np.dtype]:
    """The dtype of every parameter leaf given to ``init``, flattened:
    ``gather_params`` and exported parameters return these."""
    return self._dtypes

  def _build(self, params: Any) -> None:
    """Lays out the state for ``params`` and builds the step."""
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
    self.param_plan = Plan(master, self.mesh, pl.stage,
                           cfg.min_shard_elements)
    # Repeated blocks, run one at a time where a Flax module (or zj.layer)
    # calls them (zero_jax.blocks); which ran is known once traced.
    self.units = blocks.find_units(master)
    self.units_seen: dict[str, int] = {}
    opt_shapes = jax.eval_shape(self.tx.init, master)
    self.opt_plan = Plan(opt_shapes, self.mesh, pl.stage,
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
      opt_shardings = on_host(opt_shardings)
    if pl.master_on_host:
      param_shardings = on_host(param_shardings)
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
        compute_shardings = on_host(compute_shardings)
    self.state_shardings = TrainState(
        step=replicated, params=param_shardings,
        opt_state=opt_shardings, rng=replicated,
        compute_params=compute_shardings,
        loss_scale=(jax.tree.map(lambda _: replicated, _ls.init(cfg))
                    if pl.counts_skips else None))
    # The state's shapes and dtypes, for checking what step is given.
    self._shapes = jax.eval_shape(functools.partial(initial.make_state, self),
                                  master)
    # Offloaded state with the update on the device: streamed slice by
    # slice (zero_jax.stream), never copied to the device whole.
    self._streamer = None
    if pl.update == "streamed":
      self._streamer = stream.Streamer(self.tx, master,
                                       flat(self.param_plan.leaves),
                                       flat(self.opt_plan.leaves), self.n,
                                       stream.SLICE_BYTES)
    self._jitted = step_lib.build_jit(self)

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
      return initial.host_state(self, params)
    make_state, args = initial.initializer(self, params)
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
    shapes = jax.eval_shape(functools.partial(initial.make_state, self),
                            params)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        shapes, self.state_shardings)

  def complete_state(self, state: TrainState) -> TrainState:
    """Fills in what a checkpoint does not store: the compute copy (a cast
    of the master) and, where the state counts skips, a fresh loss scale
    state if the checkpoint had none.

    Args:
      state: a state restored into ``abstract_state``'s layout, without
        (or with a stale) ``compute_params``.

    Returns:
      The state ``step`` takes.
    """
    return initial.complete(self, state)

  def gather_params(self, state: TrainState) -> Any:
    """The full parameters, unsharded, in the tree and dtypes given to init.

    Returns replicated arrays (every device holds the whole value).
    """
    dtypes = self.param_dtypes
    treedef = self._treedef

    def gather(p):
      leaves = [x.astype(dt) for x, dt in zip(jax.tree.leaves(p), dtypes)]
      return treedef.unflatten(leaves)

    out = jax.tree.map(lambda _: self._sharding(P()), state.params)
    # (From host memory or the host's CPU devices, if offloaded.)
    params = jax.device_put(state.params, on_device(self._device_params))
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
      checks.check_batch_dim(self, x.shape,
                             nproc * x.shape[0] if x.ndim else None)
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
    dtype = pl.copy_dtype.name
    lines = [f"ZeRO stage {pl.stage} over {where_}; compute in "
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
    if self.config.remat == "auto":
      lines.append(self.remat_reason or "remat auto: chosen when the step is "
                   "first compiled (engine.step or engine.step.lower)")
    lines.extend(blocks.describe(self.units, self.units_seen, pl.stage,
                                 self.config.layer_classes))
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
