"""``Engine``: the facade over a ``StepPlan`` and its compiled step.

The engine keeps what a training script hands it (the loss, ``tx``, the
config and the mesh), lays out the state for the parameters ``init`` is
given (``StepPlan.build``), and runs the step (``engine.step``). Everything
the step does is a function of the layout; the engine only holds it.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from zero_jax.config import RematPolicy, ZeroConfig
from zero_jax.layers._units import describe_units
from zero_jax.layout import DATA, MODEL, REPLICA, Plan, decide, model_specs
from zero_jax.train import _accumulate, _agreement, _init
from zero_jax.train._grads import Loss
from zero_jax.train._step_plan import (BatchLayout, StepPlan, describe_prefetch,
                                    signature)
from zero_jax.train._runner import StepFunction
from zero_jax.train._state import TrainState, on_device


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
      ``with_rng=True``), on the full parameters in the structure given
      to ``init``. By default (``ZeroConfig.loss_scope="global"``) it
      means what it means on one device given the whole global batch;
      with ``"per_device"`` it is the *mean* loss over the examples it is
      given, run on each device's slice and averaged.
    tx: any optax transformation. The update runs on the sharded arrays as
      ordinary jit code, so global operations (norms, factored statistics)
      are exact. With ``optax.inject_hyperparams`` (e.g.
      ``optax.inject_hyperparams(optax.adamw)(learning_rate=schedule)``)
      the ``learning_rate`` metric is the rate of the last update applied.
    config: the ZeRO config.
    mesh: a mesh from ``make_mesh``: a ``data`` axis (state is sharded over
      it), optionally inside a ``replica`` axis (state replicated across it,
      gradient shards all-reduced across it) and around a ``model`` axis
      (tensor parallelism: the model's own specs split its parameters over
      it, and the compiler inserts the tensor-parallel collectives).
    has_aux: ``loss_fn`` returns ``(loss, aux)``; aux (a pytree of arrays)
      goes into the step's metrics under ``"aux"`` (averaged over devices
      with a per-device loss).
    with_rng: ``loss_fn`` takes a third argument, a PRNG key that differs on
      every step and micro-batch (and device, with a per-device loss):
      use it for dropout.
    model_specs: with a ``model`` axis, a pytree of ``PartitionSpec`` (the
      structure of the parameters) saying which dimensions the model splits
      over ``model``. Default: the parameters' Flax metadata
      (``nnx.with_partitioning``, Linen ``nn.with_partitioning`` or logical
      names), else the shardings of the arrays given to ``init``.
    axis_rules: logical axis rules (``(("mlp", "model"), ("embed",
      None), ...)``) for parameters annotated with logical names.
    loss_weight: a global loss's micro-batch weight,
      ``loss_weight(micro_batch) -> scalar``: a masked mean's count of
      valid tokens (``lambda b: b["mask"].sum()``). None: all weigh the
      same. See ``ZeroConfig.accumulation``.

  Raises:
    ValueError: the mesh has no ``data`` axis or an axis the engine does
      not use, the config's batch sizes contradict each other on this mesh
      (see ``ZeroConfig.batch_sizes``), or ``loss_weight`` does not suit
      the config (see ``ZeroConfig.accumulation``).
  """

  def __init__(self, loss_fn: Callable[..., Any],
               tx: optax.GradientTransformation, config: ZeroConfig,
               mesh: Mesh, *, has_aux: bool = False, with_rng: bool = False,
               model_specs: Any = None, axis_rules: Any = None,
               loss_weight: Callable[[Any], Any] | None = None):
    self.model_specs = model_specs
    self.axis_rules = axis_rules
    self.loss = Loss(loss_fn, has_aux, with_rng, loss_weight)
    self.tx = tx
    self.config = config
    self.mesh = mesh
    # Every choice the config leaves to the mesh, made once, each with its
    # reason: the only reader of the config.
    self.decisions = decide(config, mesh)
    self.batch = BatchLayout.of(self.decisions, mesh)
    _accumulate.check_loss(self.decisions, self.loss,
                           self.batch.grad_accum_steps)
    # Where master, moments, gradients and the compute copy live, and where
    # the update runs.
    self.placement = self.decisions.placement
    # Built by init (or abstract_state) for the layout of its parameters.
    self.layout: StepPlan | None = None
    # Why remat="auto" chose its policy (set when the step is first
    # compiled); the blocks run one at a time, once the step is traced.
    self.remat_reason: str | None = None
    self.units_seen: dict[str, int] = {}
    self.step = StepFunction(
        lambda: self.layout, self.loss, self.decisions,
        units_seen=self.units_seen,
        shard_batch=lambda batch: self.shard_batch(batch),
        on_remat=self._remat_chosen)

  # ------------------------------------------------------- what it holds
  # (The loss is ``engine.loss``, the batch sizes ``engine.batch``, the rest
  # of the layout ``engine.layout``; these are the ones scripts read most.)

  @property
  def n(self) -> int:
    """Devices state is sharded over: those on ``data``, times the
    ``replica`` groups with hpZ (``ZeroConfig.hpz_partition_size``)."""
    n = self.mesh.shape[DATA]
    if self.decisions.hierarchical:
      n *= dict(self.mesh.shape).get(REPLICA, 1)
    return n

  @property
  def train_batch_size(self) -> int | None:
    """The global batch per step, where the config fixes it."""
    return self.batch.train_batch_size

  @property
  def grad_accum_steps(self) -> int:
    """Micro-batches per step."""
    return self.batch.grad_accum_steps

  @property
  def batch_sharding(self) -> NamedSharding:
    """How ``step`` lays out a batch: leading dimension split over the
    mesh's batch axes."""
    return self.batch.sharding

  @property
  def remat(self) -> RematPolicy:
    """The remat policy the step is traced with (``AUTO`` until chosen)."""
    return (self.decisions.remat if self.layout is None else
            self.layout.remat)

  def _laid_out(self) -> StepPlan:
    if self.layout is None:
      raise RuntimeError("call engine.init(params) (or abstract_state) "
                         "first: the layout follows the parameters")
    return self.layout

  @property
  def param_plan(self) -> Plan | None:
    """The plan of the fp32 master (None before ``init``)."""
    return None if self.layout is None else self.layout.param_plan

  @property
  def opt_plan(self) -> Plan | None:
    """The plan of the optimizer state (None before ``init``)."""
    return None if self.layout is None else self.layout.opt_plan

  @property
  def state_shardings(self) -> TrainState:
    """The sharding of every leaf of the state."""
    return self._laid_out().state_shardings

  @property
  def param_dtypes(self) -> list[np.dtype]:
    """The dtype of every parameter leaf given to ``init``, flattened:
    ``gather_params`` and exported parameters return these."""
    return list(self._laid_out().param_dtypes)

  # ------------------------------------------------------------ layout

  def _lay_out(self, params: Any) -> StepPlan:
    """The layout for ``params``: built once per tree, shapes and dtypes
    (a restore after ``init`` reuses the layout and its compiled step)."""
    if self.layout is None or self.layout.signature != signature(params):
      self.layout = StepPlan.build(self.decisions, self.mesh, params, self.tx,
                                 batch=self.batch,
                                 model_specs=self._model_specs(params))
      self.units_seen.clear()
      self.remat_reason = None
    return self.layout

  def _model_specs(self, params: Any) -> list | None:
    """Per parameter leaf, the mesh axes of each dimension, from the
    user's specs, metadata or arrays; None without a ``model`` axis (a
    model split over one device is whole)."""
    if MODEL not in self.mesh.axis_names:
      return None
    return model_specs(params, self.mesh, specs=self.model_specs,
                       rules=self.axis_rules)

  def choose_remat(self, state: TrainState, batch: Any) -> None:
    """With ``remat="auto"``: compiles the step with each candidate policy
    and keeps the fastest that fits (``remat_reason`` says why)."""
    self.step.choose_remat(self._laid_out(), state, batch)

  def _remat_chosen(self, layout: StepPlan, reason: str) -> None:
    self.layout, self.remat_reason = layout, reason

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
    layout = self._lay_out(params)
    self.step.reset()  # (a fresh state: nothing carries over)
    return layout.update.init(layout, params)

  def lower_init(self, params: Any):
    """The ``Lowered`` of the program ``init`` runs (for its compiled
    memory), from the parameters or their shapes.

    Raises:
      ValueError: with ``update_on="host"``, whose init is several programs.
    """
    params = _as_arrays(params)
    layout = self._lay_out(params)
    make, args = layout.update.initializer(layout, params)
    return make.lower(*args)

  def abstract_state(self, params: Any) -> TrainState:
    """The ``TrainState`` that ``init(params)`` would build, as
    ``jax.ShapeDtypeStruct`` leaves carrying their shardings.

    Args:
      params: the parameters, or only their shapes and dtypes (e.g.
        ``jax.eval_shape(model.init, ...)``): nothing is computed or placed.

    Returns:
      The abstract state: the target to restore a checkpoint into.
    """
    return self._lay_out(_as_arrays(params)).abstract_state()

  def complete_state(self, state: TrainState) -> TrainState:
    """Fills in what a checkpoint does not store: the compute copy (a cast
    of the master) and the loss scale (the stored one where it is a float16
    run's and this engine scales the loss; else a fresh one that carries
    the stored skip count).

    Args:
      state: a state restored into ``abstract_state``'s layout, without
        (or with a stale) ``compute_params``.

    Returns:
      The state ``step`` takes.
    """
    return _init.complete(self._laid_out(), state)

  def gather_params(self, state: TrainState) -> Any:
    """The full parameters, unsharded, in the tree and dtypes given to init.

    Returns replicated arrays (every device holds the whole value).
    """
    layout = self._laid_out()

    def gather(p):
      leaves = [x.astype(dt) for x, dt in zip(jax.tree.leaves(p),
                                              layout.param_dtypes)]
      return layout.treedef.unflatten(leaves)

    out = jax.tree.map(lambda _: layout.replicated, state.params)
    # (From host memory or the host's CPU devices, if offloaded.)
    params = layout.update.to_device(state.params,
                                     on_device(layout.device_params))
    return jax.jit(gather, out_shardings=out)(params)

  def shard_batch(self, batch: Any) -> Any:
    """Places a batch on the mesh, split over ``data`` on the leading dim.

    ``jax.Array`` leaves are taken as global arrays: kept where they are
    already laid out as ``batch_sharding``, else copied there (from one
    device, as a data loader commits them, or from devices outside the
    mesh). Host (numpy) leaves are this process's slice of the global batch
    (in a single-process run: the whole batch).

    In a multi-process run every process must feed the same shapes: each
    call checks it with the others (``_agreement``: a round over JAX's
    coordination service, nothing on the devices).

    Raises:
      ValueError: in a multi-process run, a ``jax.Array`` leaf is on this
        process's devices only (the message names
        ``zero_jax.distributed.local_batch``), or the processes fed
        different rows or shapes (raised on every process).
      RuntimeError: ``python -m zero_jax.launch`` started this process as
        one of several, but ``zero_jax.distributed.initialize()`` was
        never called.
    """
    nproc = jax.process_count()
    _agreement.check_batch(batch, nproc)

    def place(path, x):
      if isinstance(x, jax.ShapeDtypeStruct):
        return x  # (shapes: for lowering)
      if isinstance(x, jax.Array):
        return self.batch.place(x, jax.tree_util.keystr(path) or "batch")
      x = np.asarray(x)
      self.batch.check(x.shape, nproc * x.shape[0] if x.ndim else None)
      return jax.make_array_from_process_local_data(self.batch.sharding, x)

    return jax.tree_util.tree_map_with_path(place, batch)

  def describe(self) -> str:
    """A table of every parameter: shape, and where it lives per device."""
    if self.layout is None:
      raise RuntimeError("call engine.init(params) before engine.describe()")
    layout, n = self.layout, self.n
    decided = layout.decisions
    pl = layout.placement
    where_ = f"{n} device(s) on '{DATA}'"
    if n == 1:  # (e.g. on CPU without zero_jax.simulate_cpu_devices)
      where_ = (f"1 device on '{DATA}', so nothing is sharded (on CPU, "
                "zero_jax.simulate_cpu_devices(n) before JAX starts gives n)")
    replica, m = (dict(self.mesh.shape).get(a, 1) for a in (REPLICA, MODEL))
    if decided.hierarchical:
      where_ = (f"{n} devices on ('{DATA}', '{REPLICA}') (hpZ: backward "
                f"gathers a secondary copy over the {self.mesh.shape[DATA]} "
                f"devices of '{DATA}')")
    elif replica > 1:
      where_ += f", replicated over {replica} '{REPLICA}' groups"
    if m > 1:
      where_ += (f", inside {m}-way tensor parallelism on '{MODEL}' (the "
                 "model's own specs)")
    lines = [f"ZeRO stage {pl.stage} over {where_}; compute in "
             f"{pl.copy_dtype.name}, master and optimizer state in float32",
             f"{'parameter':<40} {'shape':<18} layout"]
    replicated = []
    for path, lp in layout.param_plan.rows():
      per_device = lp.local_shape(n)
      if lp.model_split:
        per_device = tuple(d // m if split else d
                           for d, split in zip(per_device, lp.model))
      if lp.sharded and n == 1:
        where = f"not sharded (one device on '{DATA}'): {per_device}"
      elif lp.sharded:
        where = (f"{lp.global_spec} -> {per_device} per device" if m > 1
                 else f"sharded dim {lp.dim} -> {per_device} per device")
        if lp.both:
          where += f" (dim {lp.dim} over '{DATA}' and '{MODEL}')"
      else:
        where = f"replicated ({lp.reason})"
        if m > 1:
          where = (f"{lp.global_spec} -> {per_device} per device, "
                   f"replicated over '{DATA}' ({lp.reason})")
        replicated.append(path)
      lines.append(f"{path:<40} {str(lp.shape):<18} {where}")
    n_rep = sum(1 for _, lp in layout.opt_plan.rows() if not lp.sharded)
    lines.append(f"{len(replicated)} of {len(layout.param_plan.rows())} "
                 f"parameter leaves replicated: {replicated or 'none'}")
    lines.append(f"optimizer state: {len(layout.opt_plan.rows())} leaves, "
                 f"{n_rep} replicated (scalars, small or indivisible)")
    lines.extend(pl.describe())
    lines.extend(layout.update.describe(layout))
    lines.extend(describe_units(layout.units, self.units_seen,
                                       pl.stage, decided.layer_classes))
    if decided.delay_update:
      lines.append("delay_update: each step reads the parameters from "
                   "before the previous step's update (DeepSpeed's "
                   "delayed parameter update), so the host's update "
                   "overlaps the next step")
    # Every decision of the config on this mesh, with its reason (the
    # accumulation's and prefetch's lines know the loss and the model).
    said = {
        "accumulation": _accumulate.describe(decided, self.loss,
                                             self.grad_accum_steps),
        "prefetch": describe_prefetch(decided, layout.units),
        "remat": self.remat_reason}
    for name, line in decided.reasons:
      lines.append(said.get(name) or line)
    return "\n".join(lines)

  def replicated_params(self) -> list[str]:
    """Paths of parameter leaves that are not sharded."""
    if self.layout is None:
      raise RuntimeError("call engine.init(params) before "
                         "engine.replicated_params()")
    return [p for p, lp in self.layout.param_plan.rows() if not lp.sharded]

