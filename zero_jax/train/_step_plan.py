"""The train step's layout: everything the step needs, decided once.

``StepPlan.build(decisions, mesh, params, tx)`` turns the decisions of the
config on the mesh (``zero_jax.layout.decide``: the placement among them)
and the parameters' shapes into the plan of every
leaf, the shardings of the whole ``TrainState``, the repeated blocks of the
parameter tree, and the two strategies the step runs: how gradients are
made and reduced (``grads``) and where the optimizer update runs
(``update``: on the device, streamed through it, or on the host). The
layout is frozen; the train step, the first state and the checks of what
the user passes in are functions of it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zero_jax import layers, offload
from zero_jax._paths import path_keys, path_str
from zero_jax.config import RematPolicy
from zero_jax.layers._units import Unit
from zero_jax.layout import (DATA, MODEL, ComputeCopy, Decisions, Placement,
                             Plan, Prefetch, UpdateKind)
from zero_jax.layout._mesh import layout_mesh
from zero_jax.layout._plan import flat
# (Modules, not names: tests shrink the slices and fake the host's devices.)
from zero_jax.offload import _host, _stream
from zero_jax.train import _grads, _init, _loss_scale, _offloaded, _update
from zero_jax.train._state import TrainState, on_host


@dataclasses.dataclass(frozen=True)
class BatchLayout:
  """How a global batch is split over the mesh.

  Attributes:
    num_devices: devices the batch is split over (every batch axis).
    axes: the mesh axes of the batch's leading dimension.
    sharding: the batch's ``NamedSharding``.
    train_batch_size: the global batch per step, if the config fixes it.
    micro_batch_size: examples per device per micro-batch, if fixed.
    grad_accum_steps: micro-batches per step.
  """

  num_devices: int
  axes: tuple[str, ...]
  sharding: NamedSharding
  train_batch_size: int | None
  micro_batch_size: int | None
  grad_accum_steps: int

  @classmethod
  def of(cls, decisions: Decisions, mesh: Mesh) -> "BatchLayout":
    """The batch layout of ``decisions`` (their batch sizes) on
    ``mesh``."""
    b = decisions.batch
    spec = P(b.axes if len(b.axes) > 1 else DATA)
    return cls(b.num_devices, b.axes, NamedSharding(layout_mesh(mesh), spec),
               b.train, b.micro, b.accum_steps)

  def check(self, shape: tuple, global_size: int | None) -> None:
    """Raises unless a global batch of ``global_size`` examples suits the
    batch sizes and devices (``shape``: a leaf's shape)."""
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
        what += (f" x {self.grad_accum_steps} micro-batches "
                 "(grad_accum_steps)")
      raise ValueError(
          f"global batch size {global_size} is not divisible by {what}; use "
          f"a global batch that is a multiple of {n} (e.g. "
          f"{max(1, global_size // n) * n}).")


  def place(self, x: jax.Array, path: str) -> jax.Array:
    """A global ``jax.Array`` batch leaf laid out as the step takes it:
    itself where it already is, else copied there (e.g. from the one device
    a data loader committed it to, or from devices outside the mesh).

    Args:
      x: the leaf.
      path: its key path, for the error.

    Raises:
      ValueError: in a multi-process run, ``x`` lives on this process's
        devices only (its rows alone, or a copy per process), which no copy
        can turn into the global batch.
    """
    if x.sharding.is_equivalent_to(self.sharding, x.ndim):
      return x  # (the common case: no copy)
    nproc = jax.process_count()
    if nproc > 1 and x.is_fully_addressable:
      raise ValueError(self.foreign_batch_error(path, x.sharding, nproc))
    # Checked before the copy: device_put's own error would name tiling
    # factors, not the batch sizes.
    self.check(x.shape, x.shape[0] if x.ndim else None)
    return jax.device_put(x, self.sharding)

  def foreign_batch_error(self, path: str, sharding: Any, nproc: int) -> str:
    """The message for a batch leaf at ``path`` that is a ``jax.Array`` on
    one process's devices only (``sharding``) in a run of ``nproc``
    processes."""
    return (
        f"batch leaf {path} is a jax.Array on this process's devices only "
        f"({sharding}), but this run has {nproc} processes and the step "
        f"takes the global batch split over all of them. Pass host (numpy) "
        f"arrays of this process's rows instead: "
        f"engine.step(state, zero_jax.distributed.local_batch(batch, "
        f"mesh)) with the same global batch in every process; or a global "
        f"jax.Array laid out as engine.batch_sharding "
        f"({self.sharding.spec}).")


def describe_prefetch(decisions: Decisions,
                      units: tuple[Unit, ...] = ()) -> str:
  """``Engine.describe``'s line on the prefetch decision. Prefetch acts on
  ``scan_layers`` only: where the model has repeated blocks
  (``layers.find_units``: called in a loop), the line says that they are
  gathered at their call instead."""
  line = dict(decisions.reasons)["prefetch"]
  if decisions.prefetch is not Prefetch.OFF and units:
    line += (f"; the {len(units)} repeated blocks ({units[0].path} ...), "
             "called one by one, are gathered at their call")
  return line


def check_model_split(mesh: Mesh, plan: Plan) -> None:
  """Raises when the mesh has a ``model`` axis but no parameter is split
  over it: every model rank would repeat the same work."""
  m = dict(mesh.shape).get(MODEL, 1)
  if m > 1 and not plan.model_split:
    raise ValueError(
        f"the mesh has a {MODEL!r} axis of {m} devices but no parameter is "
        f"split over it, so its devices would repeat the same work. Give "
        "the model's tensor-parallel specs: Flax metadata "
        "(nnx.with_partitioning / nn.with_partitioning with "
        f"{MODEL!r}, or logical names with Engine(axis_rules=...)), "
        "Engine(model_specs=<pytree of PartitionSpec>), or parameters "
        f"already split over {MODEL!r}; or build the mesh without it "
        "(zero_jax.make_mesh(model=1)).")


def mirrored_specs(params: Any, specs: list, tree: Any) -> list:
  """The model specs of ``tree``'s leaves (the optimizer state): a leaf
  whose key path ends with a parameter's and has its shape (Adam's moments,
  momentum) is split as that parameter is; any other is not split."""
  by_path = {}
  for (path, x), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                             specs):
    by_path[path_keys(path)] = (tuple(np.shape(x)), spec)
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    names, found = path_keys(path), ()
    for start in range(len(names)):
      hit = by_path.get(names[start:])
      if hit is not None and hit[0] == tuple(np.shape(x)):
        found = hit[1]
        break
    out.append(found)
  return out


@dataclasses.dataclass(frozen=True, eq=False)
class StepPlan:
  """Everything the train step needs, decided once from config, mesh,
  parameter shapes and ``tx``.

  Attributes:
    decisions: the decisions of the ZeRO config on this mesh
      (``zero_jax.layout.decide``), at the remat policy the step is traced
      with (``AUTO`` until ``Engine`` has chosen one).
    mesh: the mesh (``data``, optionally inside ``replica``).
    tx: the optax transformation.
    placement: where each part of the state lives.
    batch: how a global batch is split.
    param_plan: the ``Plan`` of the fp32 master parameters.
    opt_plan: the ``Plan`` of the optimizer state.
    treedef: the tree of the parameters given to ``Engine.init``.
    param_dtypes: their dtypes, flattened.
    units: the repeated blocks of the parameter tree
      (``zero_jax.layers.find_units``).
    state_shardings: the ``TrainState`` of every leaf's sharding.
    state_shapes: the ``TrainState`` of every leaf's shape and dtype.
    device_params: the master's shardings in device memory (for the
      update; replicated at stages 0-2 in fp32).
    device_opt: the optimizer state's shardings in device memory.
    grads: how gradients are made and reduced (``zero_jax.train._grads``).
    update: where and how the optimizer update runs
      (``zero_jax.train._update``).
  """

  decisions: Decisions
  mesh: Mesh
  tx: optax.GradientTransformation
  batch: BatchLayout
  param_plan: Plan
  opt_plan: Plan
  treedef: Any
  param_dtypes: tuple[np.dtype, ...]
  units: tuple[Unit, ...]
  state_shardings: TrainState
  state_shapes: TrainState | None
  device_params: Any
  device_opt: Any
  grads: _grads.GradsStrategy
  update: _update.UpdateStrategy

  @property
  def n(self) -> int:
    """Devices state is sharded over: ``data`` (and ``replica`` with
    hpZ)."""
    return self.param_plan.n

  @property
  def signature(self) -> tuple:
    """The tree, shapes and dtypes of the parameters it was built for."""
    return (self.treedef,
            tuple(tuple(x.shape) for x in
                  jax.tree.leaves(self.state_shapes.params)),
            self.param_dtypes)

  @property
  def placement(self) -> Placement:
    """Where each part of the state lives (``Decisions.placement``)."""
    return self.decisions.placement

  @property
  def remat(self) -> RematPolicy:
    """The remat policy the step is traced with (``AUTO`` until
    ``Engine`` has chosen one)."""
    return self.decisions.remat

  @property
  def prefetch(self) -> Prefetch:
    """Whether scanned layers are gathered one layer ahead (at this
    layout's remat policy)."""
    return self.decisions.prefetch

  def with_remat(self, remat: RematPolicy) -> "StepPlan":
    """This layout traced with another remat policy (prefetch decided
    again for it)."""
    return dataclasses.replace(self, decisions=self.decisions.with_remat(
        remat))

  @property
  def replicated(self) -> NamedSharding:
    """The sharding of a replicated array."""
    return self.sharding(P())

  def sharding(self, spec: P) -> NamedSharding:
    """A ``NamedSharding`` on this mesh (the abstract mesh for compile-only
    devices, so that host memory kinds survive)."""
    return NamedSharding(layout_mesh(self.mesh), spec)

  @classmethod
  def build(cls, decisions: Decisions, mesh: Mesh, params: Any,
            tx: optax.GradientTransformation, *,
            batch: BatchLayout | None = None,
            model_specs: list | None = None) -> "StepPlan":
    """The layout for ``params`` (arrays or shapes; floating leaves only).

    ``model_specs``: per parameter leaf, the mesh axes of each dimension
    (``zero_jax.layout.model_specs``); None: split over no ``model`` axis.

    Raises:
      TypeError: a parameter leaf is not floating point.
      ValueError: the model's split does not suit the mesh, or the
        streamed offload update cannot split ``tx`` (see
        ``zero_jax.offload.Streamer``).
    """
    hierarchical = decisions.hierarchical
    batch = batch or BatchLayout.of(decisions, mesh)
    pl = decisions.placement
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
      if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"parameter {path_str(path)!r} has dtype {x.dtype}; pass only "
            "trainable floating-point leaves (for Flax NNX: "
            "nnx.split(model, nnx.Param)).")
    master = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32),
                          params)
    opt_shapes = jax.eval_shape(tx.init, master)

    def plans(stage: int) -> tuple[Plan, Plan]:
      return (Plan(master, mesh, stage, decisions.min_shard_elements,
                   model_specs, hierarchical),
              Plan(opt_shapes, mesh, stage, decisions.min_shard_elements,
                   None if model_specs is None else
                   mirrored_specs(master, model_specs, opt_shapes),
                   hierarchical))

    param_plan, opt_plan = plans(pl.stage)
    check_model_split(mesh, param_plan)
    replicated = NamedSharding(layout_mesh(mesh), P())
    # Replicated over ``data``: still split over ``model`` as the model is.
    replicated_tree = param_plan.replicated_shardings
    device_params = (param_plan.shardings if pl.master_sharded else
                     replicated_tree)
    params_sh = on_host(device_params) if pl.master_on_host else device_params
    opt_sh = (on_host(opt_plan.shardings) if pl.opt_on_host else
              opt_plan.shardings)
    compute_sh = {ComputeCopy.REPLICATED: replicated_tree,
                  ComputeCopy.SHARDED: param_plan.shardings,
                  None: None}[pl.compute_copy]
    streamer = host = None
    if pl.update is UpdateKind.HOST:
      mirrored = None
      if jax.process_count() > 1:
        # Laid out as the devices' ZeRO shards: stage 1's at stage 0,
        # whose plan shards nothing.
        mirrored = (param_plan, opt_plan) if pl.stage else plans(1)
      host = _host_update(tx, master, mesh, mirrored, decisions)
      params_sh, opt_sh = host.master_shardings, host.opt_shardings
      if pl.compute_memory.on_host:
        compute_sh = on_host(compute_sh)
    elif pl.update is UpdateKind.STREAMED:
      # Offloaded state with the update on the device: streamed slice by
      # slice, never copied to the device whole.
      streamer = offload.Streamer(tx, master, flat(param_plan.leaves),
                                  flat(opt_plan.leaves), mesh.shape[DATA],
                                  _stream.SLICE_BYTES)
    state_shardings = TrainState(
        step=replicated, params=params_sh, opt_state=opt_sh, rng=replicated,
        compute_params=compute_sh,
        loss_scale=(jax.tree.map(
            lambda _: replicated,
            jax.eval_shape(lambda: _loss_scale.init(decisions)))
                    if pl.counts_skips else None))
    layout = cls(
        decisions=decisions, mesh=mesh, tx=tx, batch=batch,
        param_plan=param_plan, opt_plan=opt_plan,
        treedef=jax.tree.structure(params),
        param_dtypes=tuple(jnp.dtype(x.dtype)
                           for x in jax.tree.leaves(params)),
        units=layers.find_units(master), state_shardings=state_shardings,
        state_shapes=None, device_params=device_params,
        device_opt=opt_plan.shardings,
        grads=_grads.strategy(pl, param_plan.leaves, batch.axes,
                              param_plan.n,
                              None if streamer is None else streamer.cuts),
        update=(_offloaded.Streamed(streamer) if streamer is not None else
                _offloaded.OnHost(host) if host is not None else
                _update.OnDevice()))
    # The state's shapes and dtypes, for checking what the step is given.
    return dataclasses.replace(layout, state_shapes=jax.eval_shape(
        functools.partial(_init.make_state, layout), master))

  def abstract_state(self) -> TrainState:
    """The state as ``jax.ShapeDtypeStruct`` leaves with their shardings."""
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        self.state_shapes, self.state_shardings)


def signature(params: Any) -> tuple:
  """What a layout depends on of the parameters: their tree, shapes and
  dtypes."""
  leaves = jax.tree.leaves(params)
  return (jax.tree.structure(params),
          tuple(tuple(np.shape(x)) for x in leaves),
          tuple(jnp.dtype(x.dtype) for x in leaves))


def _host_update(tx: optax.GradientTransformation, master: Any,
                 mesh: Mesh, mirrored: tuple[Plan, Plan] | None,
                 decisions: Decisions
                 ) -> offload.HostUpdate | offload.FusedUpdate:
  """ZeRO-Offload's split: master and optimizer state in host buffers (in
  files with ``offload_optimizer="nvme"``), updated by the fused host
  optimizer where ``tx`` is one it runs, else on the host's CPU devices by
  a program of their own. ``mirrored`` (a multi-process run): the plans of
  the master and the optimizer state, whose shards each process updates
  for its own devices."""
  rule = offload.rule_of(tx)
  if decisions.nvme:
    if rule is None:
      raise ValueError(
          "offload_optimizer='nvme' runs the fused host optimizer on each "
          "slice read from disk: build the optimizer with zero_jax.offload's "
          "adamw, adam, lion, sgd or adagrad (or a DeepSpeed optimizer "
          "section through zj.initialize), not this optax transformation")
    if mirrored is not None:
      raise ValueError(
          "offload_optimizer='nvme' runs in single-process runs for now "
          f"(this run has {jax.process_count()} processes): use "
          "offload_optimizer='host' across processes")
    return offload.NvmeUpdate(tx, rule, master,
                              _host.host_devices(mesh)[0],
                              decisions.offload.nvme_path,
                              decisions.offload.nvme,
                              decisions.delay_update)
  if mirrored is None and rule is not None:
    return offload.FusedUpdate(tx, rule, master,
                               _host.host_devices(mesh)[0],
                               decisions.delay_update)
  if mirrored is not None:
    specs = [jax.tree.map(lambda s: s.spec, p.shardings) for p in mirrored]
    if rule is not None:
      return offload.MirroredFused(tx, rule, master, mesh, *specs)
    return offload.MirroredUpdate(tx, master, mesh, *specs)
  host = offload.HostUpdate(tx, master, _host.host_devices(mesh))
  if host.k == 1 and (os.cpu_count() or 1) > 1:
    warnings.warn(
        "update_on='host' has 1 CPU device, so the update may use one "
        f"core of {os.cpu_count()}: call jax.config.update("
        "'jax_num_cpu_devices', os.cpu_count()) before JAX starts (before "
        "anything creates an array or lists devices).", stacklevel=4)
  return host
