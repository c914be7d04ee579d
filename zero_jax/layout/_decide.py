"""The decision pass: every choice a ``ZeroConfig`` leaves to the mesh,
made once, each with its reason.

``decide(config, mesh)`` is the one reader of the config after it is
validated: the placement of the state, the batch sizes, prefetch, hpZ,
the loss's meaning, remat's inputs, loss scaling, skipping and clipping.
The step, its strategies, ``analysis`` and ``checkpoint`` read the frozen
``Decisions`` it returns, never the config; ``Engine.describe()`` prints
each decision beside its reason.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from zero_jax.config import (Accumulation, LossScaling, LossScope, Offload,
                             RematPolicy, Tier, UpdateOn, ZeroConfig)
from zero_jax.layout._mesh import DATA, MODEL, REPLICA, batch_axes
from zero_jax.layout._placement import (ComputeCopy, GatherFrom, Materialize,
                                        Memory, Placement, Prefetch,
                                        Quantize, UpdateKind)


@dataclasses.dataclass(frozen=True)
class BatchSizes:
  """How many examples a step takes, by DeepSpeed's rule ``train = micro
  * accum_steps * devices``.

  Attributes:
    num_devices: devices the batch is split over (every batch axis).
    axes: the mesh axes of the batch's leading dimension.
    train: the global batch per step, if the config fixes it.
    micro: examples per device per micro-batch, if fixed.
    accum_steps: micro-batches per step.
  """

  num_devices: int
  axes: tuple[str, ...]
  train: int | None
  micro: int | None
  accum_steps: int


@dataclasses.dataclass(frozen=True)
class Decisions:
  """Every choice of one config on one mesh (``decide``), frozen.

  Attributes:
    stage: the ZeRO stage.
    placement: where each part of the state lives and the update runs.
    batch: the batch sizes on this mesh.
    prefetch: whether scanned layers are gathered one layer ahead, at
      ``remat``.
    asked_prefetch: what the config asked (True, False or ``"auto"``).
    hierarchical: hpZ's groups (a ``replica`` axis of them) are in use.
    loss_scope: what ``loss_fn``'s value means.
    accumulation: what a step of several micro-batches trains (resolved:
      the whole batch's loss for a global loss unless DeepSpeed's mean was
      asked for; the mean with a per-device loss).
    remat: the remat policy the step is traced with (``AUTO`` until
      ``Engine`` has chosen one at the first compile).
    remat_names: the ``checkpoint_name`` tags the named policies act on.
    partition_activations: ZeRO-R's Pa.
    device_memory_bytes: the memory per device ``remat="auto"`` fits the
      step into (None: what the device reports).
    layer_classes: the blocks run one at a time in a Python loop (None:
      found; ``()``: none).
    min_shard_elements: leaves with fewer elements are replicated.
    loss_scaling: float16's loss-scaling constants.
    skip_nonfinite: non-finite steps are skipped on every device.
    max_consecutive_skips: skipped steps in a row before ``step`` raises.
    clip_grad_norm: the global norm gradients are clipped to, or None.
    seed: seed of the per-step PRNG key.
    offload: the offload section (tier, NVMe directory and options, the
      delayed update).
    reasons: ``(decision, line)``: ``describe``'s line on each decision,
      its value and its reason.
    mesh_shape: the mesh's ``(axis, size)`` pairs, which ``with_remat``
      decides prefetch on again.
  """

  stage: int
  placement: Placement
  batch: BatchSizes
  prefetch: Prefetch
  asked_prefetch: bool | str
  hierarchical: bool
  loss_scope: LossScope
  accumulation: Accumulation
  remat: RematPolicy
  remat_names: tuple[str, ...]
  partition_activations: bool
  device_memory_bytes: int | None
  layer_classes: tuple[str, ...] | None
  min_shard_elements: int
  loss_scaling: LossScaling
  skip_nonfinite: bool
  max_consecutive_skips: int
  clip_grad_norm: float | None
  seed: int
  offload: Offload
  reasons: tuple[tuple[str, str], ...]
  mesh_shape: tuple[tuple[str, int], ...] = ()

  @property
  def global_loss(self) -> bool:
    """The loss has one device's meaning (``loss_scope="global"``)."""
    return self.loss_scope is LossScope.GLOBAL

  @property
  def nvme(self) -> bool:
    """The optimizer state lives in files (``offload_optimizer="nvme"``)."""
    return self.offload.optimizer is Tier.NVME

  @property
  def delay_update(self) -> bool:
    """The host's update runs one step late (``delay_update``)."""
    return self.offload.delay

  def with_remat(self, remat: RematPolicy) -> "Decisions":
    """The decisions at another remat policy (what ``remat="auto"``
    chose): prefetch is decided again for it."""
    prefetch, why = _prefetch(self.asked_prefetch, self.placement,
                              dict(self.mesh_shape), remat,
                              self.partition_activations, self.hierarchical,
                              self.global_loss)
    return dataclasses.replace(
        self, remat=remat, prefetch=prefetch,
        reasons=_replace(self.reasons, ("prefetch", why),
                         ("remat", _remat_line(remat))))

  def describe(self) -> list[str]:
    """One line per decision: its value and its reason."""
    return [line for _, line in self.reasons]


def decide(config: ZeroConfig, mesh) -> Decisions:
  """Every decision of ``config`` on ``mesh``.

  Raises:
    ValueError: the mesh does not suit the config (an axis the engine does
      not use, hpZ's groups), or its batch sizes contradict each other on
      this mesh; each message names the fix.
  """
  check_mesh(mesh)
  shape = dict(mesh.shape)
  hierarchical = _hpz(config.hpz_partition_size, shape)
  axes = batch_axes(mesh)
  num_devices = int(np.prod([shape[a] for a in axes]))
  train, micro, accum = config.batch_sizes(num_devices)
  batch = BatchSizes(num_devices, axes, train, micro, accum)
  placement = decide_placement(config, accum)
  glob = config.loss_scope is LossScope.GLOBAL
  accumulation = config.accumulation or (
      Accumulation.WHOLE_BATCH if glob else
      Accumulation.MEAN_OF_MICRO_BATCHES)
  remat = config.remat
  prefetch, prefetch_why = _prefetch(
      config.prefetch, placement, shape, remat, config.partition_activations,
      hierarchical, glob)
  reasons = (
      ("batch", "batch: " + _batch_reason(batch)),
      ("loss", "loss: " + _loss_reason(glob, placement)),
      ("accumulation", "accumulation: " + _accumulation_reason(
          accumulation, accum, config.accumulation is None)),
      ("remat", _remat_line(remat)),
      ("prefetch", prefetch_why),
      ("hpZ", "hpZ: " + (
          f"groups of {config.hpz_partition_size} devices on {DATA!r}, "
          f"{shape.get(REPLICA, 1)} groups on {REPLICA!r}" if hierarchical
          else "off (hpz_partition_size=1)")),
      ("loss scaling", "loss scaling: " + _scaling_reason(config)),
      ("non-finite steps", "non-finite steps: " + (
          f"skipped on every device, at most {config.max_consecutive_skips}"
          " in a row" if config.skip_nonfinite or placement.loss_scaling
          else "applied (skip_nonfinite=False)")),
      ("clipping", "clipping: " + (
          "none (clip_grad_norm=None)" if config.clip_grad_norm is None
          else f"to global norm {config.clip_grad_norm:g}, computed over "
          "every shard")),
  )
  return Decisions(
      stage=config.stage, placement=placement, batch=batch,
      prefetch=prefetch, asked_prefetch=config.prefetch,
      hierarchical=hierarchical, loss_scope=config.loss_scope,
      accumulation=accumulation, remat=remat,
      remat_names=config.remat_names,
      partition_activations=config.partition_activations,
      device_memory_bytes=config.device_memory_bytes,
      layer_classes=config.layer_classes,
      min_shard_elements=config.min_shard_elements,
      loss_scaling=config.loss_scaling,
      skip_nonfinite=config.skip_nonfinite,
      max_consecutive_skips=config.max_consecutive_skips,
      clip_grad_norm=config.clip_grad_norm, seed=config.seed,
      offload=config.offload, reasons=reasons,
      mesh_shape=tuple(shape.items()))


def check_mesh(mesh) -> None:
  """Raises unless ``mesh`` has a ``data`` axis and no axis the engine does
  not use (its devices would silently repeat the same work)."""
  if DATA not in mesh.axis_names:
    raise ValueError(f"mesh must have a {DATA!r} axis (use "
                     f"zero_jax.make_mesh()); got axes {mesh.axis_names}")
  unused = [a for a in mesh.axis_names if a not in (DATA, REPLICA, MODEL)
            and mesh.shape[a] > 1]
  if unused:
    raise ValueError(
        f"mesh axis {unused[0]!r} (size {mesh.shape[unused[0]]}) is not one "
        f"the engine uses ({DATA!r}, {REPLICA!r}, {MODEL!r}): its devices "
        "would repeat the same work. Build the mesh with "
        "zero_jax.make_mesh(replica=..., model=...), or rename a "
        f"tensor-parallel axis to {MODEL!r}.")


def _hpz(k: int, shape: dict[str, int]) -> bool:
  """Whether hpZ is asked for; raises unless the mesh has its groups: a
  ``replica`` axis, each group ``k`` devices on ``data``, and no ``model``
  axis."""
  if k == 1:
    return False
  total = int(np.prod(list(shape.values())))
  if shape.get(REPLICA, 1) == 1 or shape[DATA] != k or shape.get(MODEL, 1) > 1:
    fix = (f"zero_jax.make_mesh(replica={total // k})" if total % k == 0
           else f"a partition size that divides the {total} devices")
    raise ValueError(
        f"ZeroConfig.hpz_partition_size={k} (hpZ) needs a mesh of groups of"
        f" {k} devices: a {REPLICA!r} axis of groups, {DATA!r} of {k}, and "
        f"no {MODEL!r} axis (got {shape}). Use {fix}, or "
        "hpz_partition_size=1.")
  return True


def _prefetch(asked: bool | str, placement: Placement,
              shape: dict[str, int], remat: RematPolicy, partition: bool,
              hierarchical: bool, glob: bool) -> tuple[Prefetch, str]:
  """``ZeroConfig.prefetch`` for this layout, and why: asked for (the
  config has refused what it cannot honour), off, or, for ``"auto"``, on
  where it is built and measured: stage 3 gathering from the float32
  master, or stage 2 gathering it and keeping it (``keeps_gathered``, with
  a loss of per-device meaning only), remat ``full``, no Pa, hpZ or
  ``model`` axis, over more than one device."""
  kept = placement.keeps_gathered
  on = (f"prefetch ({asked}): each layer that zero_jax.layers.scan_layers "
        "runs is gathered while the one before it runs, "
        + ("and kept for backward" if kept else "forward and backward"))
  if asked is True:
    return Prefetch.ON, on
  if (asked == "auto" and placement.materialize is Materialize.GATHER
      and not (glob and kept) and remat is RematPolicy.FULL
      and not partition and not hierarchical
      and shape.get(MODEL, 1) == 1
      and shape[DATA] * shape.get(REPLICA, 1) > 1):
    return Prefetch.AUTO, on
  if asked == "auto":
    return Prefetch.OFF, (
        "prefetch (auto): off; it needs stage 3 gathering from the "
        "float32 master, or stage 2 with a compute_dtype, no offload, "
        "one micro-batch a step and loss_scope='per_device'; remat "
        "'full', no Pa, hpZ or 'model' axis, and more than one device")
  return Prefetch.OFF, "prefetch (False): off"


def decide_placement(config: ZeroConfig, grad_accum_steps: int = 1
                     ) -> Placement:
  """Where each part of the state of ``config`` lives, and where its
  update runs, with this many micro-batches per step (an accumulator
  stays on the device): the rules of ``zero_jax.layout.Placement``."""
  cd = config.compute_dtype
  cd = None if cd in (None, "float32") else jnp.dtype(cd)
  rd = config.reduce_dtype
  glob = config.loss_scope is LossScope.GLOBAL
  # Unless asked otherwise (see MixedPrecision), a global loss's gradients
  # are summed in the compute dtype, where the compiler's reduce-scatter
  # finds them; the per-device step's own collectives sum them in fp32.
  rd = (jnp.dtype(rd) if rd is not None else None if cd is None else
        cd if glob else jnp.dtype(jnp.float32))
  stage = config.stage
  offload_opt = config.offload_optimizer is Tier.HOST
  offload_params = config.offload_params is not None
  loss_scaling = config.compute_dtype == "float16"
  # Gradients straight to host memory, as backward makes them: the
  # per-device step's own collectives do that, and with a global loss the
  # stage-3 leaves the engine hands over itself. (Several micro-batches'
  # gradients are summed in device memory first.)
  one_pass = grad_accum_steps == 1 and (not glob or stage == 3)
  counts_skips = loss_scaling or config.skip_nonfinite
  quantize = Quantize(weights=config.quantized_weights,
                      gradients=config.quantized_gradients)
  if config.update_on is UpdateOn.HOST:
    # ZeRO-Offload's split: the device only ever holds the compute copy.
    gather_from = None
    if stage == 3:
      gather_from = (GatherFrom.HOST_COMPUTE if offload_params else
                     GatherFrom.COMPUTE)
    return Placement(
        stage=stage, compute_dtype=cd, reduce_dtype=rd,
        master_sharded=stage > 0, master_memory=Memory.HOST_CPU,
        opt_memory=Memory.HOST_CPU,
        compute_copy=(ComputeCopy.SHARDED if stage == 3 else
                      ComputeCopy.REPLICATED),
        compute_memory=(Memory.PINNED_HOST if offload_params else
                        Memory.DEVICE),
        gather_from=gather_from, update=UpdateKind.HOST,
        loss_scaling=loss_scaling, counts_skips=counts_skips,
        quantize=quantize, grads_on_host=stage == 3 and one_pass)
  compute_copy = None
  # Stage 2 gathering the master's shards in forward instead of keeping a
  # compute copy (FSDP's SHARD_GRAD_OP): only where nothing streams the
  # state, and once per step, as the post-update gather it replaces. (Not
  # with a loss of global meaning, whose collectives are the compiler's:
  # stage 2 keeps its replicated copy there.)
  gathers_master = (stage == 2 and cd is not None and not offload_opt
                    and config.prefetch is not False and not glob)
  if gathers_master and grad_accum_steps > 1:
    if config.prefetch is True:
      raise ValueError(
          "ZeroConfig.prefetch at stage 2 gathers the parameters in "
          "forward, so each of the grad_accum_steps="
          f"{grad_accum_steps} micro-batches would gather them again, where "
          "the all-gather after the update runs once a step: use "
          "prefetch='auto' (off with accumulation) or False.")
    gathers_master = False
  if stage in (1, 2) and cd is not None and not gathers_master:
    compute_copy = ComputeCopy.REPLICATED
  elif stage == 3 and cd is not None and offload_opt and not offload_params:
    compute_copy = ComputeCopy.SHARDED
  master_on_host = offload_params or (offload_opt and
                                      compute_copy is not None)
  gather_from = GatherFrom.MASTER if gathers_master else None
  if stage == 3:
    gather_from = (GatherFrom.HOST_MASTER if offload_params else
                   GatherFrom.COMPUTE if compute_copy else
                   GatherFrom.MASTER)
  update = (UpdateKind.STREAMED if offload_opt or offload_params else
            UpdateKind.DEVICE)
  return Placement(
      stage=stage, compute_dtype=cd, reduce_dtype=rd,
      master_sharded=(stage == 3 or compute_copy is not None
                      or gathers_master),
      master_memory=(Memory.PINNED_HOST if master_on_host else
                     Memory.DEVICE),
      opt_memory=Memory.PINNED_HOST if offload_opt else Memory.DEVICE,
      compute_copy=compute_copy, gather_from=gather_from, update=update,
      loss_scaling=loss_scaling, counts_skips=counts_skips,
      quantize=quantize,
      grads_on_host=(gather_from in (GatherFrom.COMPUTE,
                                     GatherFrom.HOST_MASTER)
                     and update is UpdateKind.STREAMED and one_pass))


def _batch_reason(b: BatchSizes) -> str:
  where = " x ".join(b.axes)
  if b.train is None:
    return (f"free global batch, split over {b.num_devices} devices "
            f"({where}), {b.accum_steps} micro-batch(es) a step")
  return (f"train_batch_size {b.train} = micro_batch_size {b.micro} x "
          f"grad_accum_steps {b.accum_steps} x {b.num_devices} devices "
          f"({where})")


def _loss_reason(glob: bool, placement: Placement) -> str:
  if not glob:
    return ("per device (loss_fn on each device's slice of the batch, "
            "averaged: DeepSpeed's meaning)")
  summed = jnp.dtype(placement.reduce_dtype or jnp.float32).name
  return ("global (loss_fn once over the whole batch: one device's "
          f"meaning; every collective the compiler's, gradients summed in "
          f"{summed})")


def _accumulation_reason(accumulation: Accumulation, steps: int,
                         default: bool) -> str:
  why = "the loss scope's meaning" if default else "asked for"
  if steps == 1:
    return f"{accumulation.value} ({why}; one micro-batch a step)"
  return f"{accumulation.value} over {steps} micro-batches ({why})"


def _remat_line(remat: RematPolicy) -> str:
  if remat is RematPolicy.AUTO:
    return ("remat (auto): the fastest policy whose compiled step fits the "
            "device, chosen when the step is first compiled")
  return f"remat ({remat.value}): {remat.description}"


def _scaling_reason(config: ZeroConfig) -> str:
  if config.compute_dtype != "float16":
    return (f"off ({config.compute_dtype or 'float32'} compute has "
            "float32's range)")
  s = config.loss_scaling
  if s.scale > 0:
    return f"static, {s.scale:g} (float16 compute)"
  return (f"dynamic (float16 compute): 2**{s.initial_power} at first, "
          f"halved after {s.hysteresis} overflow(s), doubled after "
          f"{s.window} clean steps, at least {s.min_scale:g}")


def _replace(reasons: tuple[tuple[str, str], ...],
             *new: tuple[str, str]) -> tuple[tuple[str, str], ...]:
  """``reasons`` with the lines named in ``new`` replaced."""
  by_name = dict(new)
  return tuple((name, by_name.get(name, why)) for name, why in reasons)
