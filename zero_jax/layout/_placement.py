"""Where each part of the ZeRO state lives, and where the update runs.

One object, decided once from the config by the decision pass
(``zero_jax.layout.decide_placement``): the train step lays out and
updates the state by it, ``estimate_memory`` counts bytes by it, and
``Engine.describe()`` prints it. The rules:

- the fp32 master is sharded at stage 3, at stages 1-2 when forward
  reads a separate compute-dtype copy, and at stage 2 when forward gathers
  it (below); otherwise it is replicated (stage 0,
  and stages 1-2 in fp32, where the replicated compute copy *is* the
  master and each device updates the slice it owns);
- a separate compute copy exists at stages 1-2 with a ``compute_dtype``
  (replicated, refreshed by an all-gather after each update; not at stage
  2 with ``prefetch``, one micro-batch a step and the state on the device,
  where forward gathers the master's shards in the compute dtype, layer by
  layer, and keeps them for backward), and at stage 3 with a
  ``compute_dtype`` when the master is offloaded but the parameters are
  not (sharded, refreshed by a cast);
- offload puts the optimizer state in pinned host memory, and the master
  too wherever forward does not read it (it reads the compute copy), or at
  stage 3 with ``offload_params`` (forward copies each layer's master
  shards to the device as it gathers them);
- offloaded state is updated by streaming it through the device a slice at
  a time (``zero_jax.offload.Streamer``);
- with ``update_on="host"`` (ZeRO-Offload's split) master and optimizer
  state live on the host's CPU devices and a program of their own updates
  them there (``zero_jax.offload.HostUpdate``); the device keeps a compute
  copy (in the compute dtype, else float32: sharded at stage 3, replicated
  below; in pinned host memory with ``offload_params``, gathered layer by
  layer) and sends gradients to the host.
"""

from __future__ import annotations

import dataclasses
import enum

import jax.numpy as jnp
import numpy as np


class Memory(enum.Enum):
  """Where an array lives between steps."""

  DEVICE = "device"
  # Pinned host memory, addressed by the accelerator's own programs.
  PINNED_HOST = "pinned_host"
  # Host RAM as arrays on the host's CPU devices (update_on="host"),
  # outside the accelerator's programs.
  HOST_CPU = "cpu"

  @property
  def on_host(self) -> bool:
    """Outside device memory."""
    return self is not Memory.DEVICE


class ComputeCopy(enum.Enum):
  """The separate compute-dtype copy of the parameters forward reads."""

  REPLICATED = "replicated"
  SHARDED = "sharded"


class GatherFrom(enum.Enum):
  """Stage 3: what each parameter is all-gathered from."""

  MASTER = "master"  # the fp32 master shards
  COMPUTE = "compute"  # the sharded compute copy
  HOST_MASTER = "host_master"  # the offloaded master, a layer at a time
  HOST_COMPUTE = "host_compute"  # the compute copy in pinned host memory

  @property
  def from_host(self) -> bool:
    """The shards are in host memory: each is copied to the device (one
    layer at a time inside a scan) before the all-gather."""
    return self in (GatherFrom.HOST_MASTER, GatherFrom.HOST_COMPUTE)


class UpdateKind(enum.Enum):
  """Where and how the optimizer update runs."""

  DEVICE = "device"  # whole, on device-resident state
  STREAMED = "streamed"  # offloaded state, slice by slice through the device
  HOST = "host"  # a program of its own on the host's CPU devices


class Prefetch(enum.Enum):
  """Whether scanned layers are gathered one layer ahead
  (``ZeroConfig.prefetch``, decided by the layout)."""

  OFF = "off"
  # On, decided for the layout: a scan that cannot honour it (another
  # remat policy, parameters not gathered from their shards) runs plain.
  AUTO = "auto"
  # Asked for: a scan that cannot honour it raises.
  ON = "on"


class Materialize(enum.Enum):
  """How forward gets each sharded parameter whole, and where its gradient
  goes (``zero_jax.materialize.Materializer``)."""

  # Stages 0-1: the parameters are whole already; gradients are reduced
  # after backward.
  LOCAL = "local"
  # Stage 2 with a replicated copy: it is used, and its gradient
  # reduce-scattered as backward makes it.
  SCATTER = "scatter"
  # Stage 3 from the fp32 master shards, differentiated themselves (and
  # stage 2 gathering in forward, ``Placement.keeps_gathered``).
  GATHER = "gather"
  # Stage 3 from another copy (the sharded compute copy or host memory);
  # the gradient goes to a zero-valued stand-in of the shard.
  GATHER_FROM = "gather_from"
  # A loss of global meaning (no ``shard_map`` over the batch): a layer's
  # float32 shards (or, with offload_params, their copy from host memory)
  # cast to the compute dtype, which a sharding constraint has the
  # compiler gather, and whose custom transpose has it reduce-scatter the
  # gradient (``zero_jax.materialize.gather_constrained``).
  CONSTRAIN = "constrain"
  # Stage 2 with a loss of global meaning: the replicated copy is used as
  # it is, and a custom transpose has the compiler reduce-scatter its
  # gradient where backward makes it (``use_constrained``).
  CONSTRAIN_SCATTER = "constrain_scatter"


@dataclasses.dataclass(frozen=True)
class Quantize:
  """ZeRO++'s quantized collectives (arXiv:2306.10209), both approximate.

  A quantized array crosses as int8 blocks of ``block`` elements along its
  last dimension (the whole of that dimension where ``block`` does not
  divide it), each with its own float32 scale, ``max |x| / 127``: an
  element is off by at most half its block's scale.

  Attributes:
    weights: qwZ: stage 3's parameter all-gathers move int8 blocks, made
      from the float32 master shard and dequantized at use.
    gradients: qgZ: gradients cross as int8 blocks by an all-to-all, and
      each device dequantizes its shard's blocks and sums them in float32.
    block: elements per scale.
  """

  weights: bool = False
  gradients: bool = False
  block: int = 256


@dataclasses.dataclass(frozen=True)
class Placement:
  """The layout decisions of one ``ZeroConfig`` (``decide_placement``).

  Attributes:
    stage: the ZeRO stage.
    compute_dtype: dtype of forward and backward (None: float32).
    reduce_dtype: dtype gradients are summed in across devices (None: as
      computed, float32).
    master_sharded: the fp32 master is sharded (else replicated).
    master_memory: where the master lives.
    opt_memory: where the optimizer state lives.
    compute_copy: the separate compute-dtype copy forward reads, or None.
    compute_memory: where the compute copy lives.
    gather_from: stage 3: what parameters are gathered from; stage 2:
      ``MASTER`` where forward gathers the master's shards in the compute
      dtype (``keeps_gathered``); None otherwise.
    update: where the optimizer update runs.
    loss_scaling: float16 loss scaling is on.
    grads_on_host: stage 3 with offloaded, streamed state (or the update
      on the host) and one micro-batch per step: each gradient shard goes
      to host memory as backward makes it (ZeRO-Offload), and the update
      reads it from there.
    quantize: ZeRO++'s quantized collectives, where asked for.
    counts_skips: the state keeps a ``LossScaleState`` (loss scaling, or
      ``skip_nonfinite``, where its scale stays 1): its ``skipped`` count
      says how many updates were applied, which is where the learning rate
      schedule is.
  """

  stage: int
  compute_dtype: np.dtype | None
  reduce_dtype: np.dtype | None
  master_sharded: bool
  master_memory: Memory
  opt_memory: Memory
  compute_copy: ComputeCopy | None
  gather_from: GatherFrom | None
  update: UpdateKind
  loss_scaling: bool
  grads_on_host: bool = False
  compute_memory: Memory = Memory.DEVICE
  quantize: Quantize = Quantize()
  counts_skips: bool = False

  @property
  def master_on_host(self) -> bool:
    """The master lives outside device memory (pinned host or CPU)."""
    return self.master_memory.on_host

  @property
  def opt_on_host(self) -> bool:
    """The optimizer state lives outside device memory."""
    return self.opt_memory.on_host

  @property
  def grads_sharded(self) -> bool:
    """Gradients reach the update sharded like the master's plan (stages
    1-3); at stage 0 they are all-reduced, replicated."""
    return self.stage > 0

  @property
  def master_regathered(self) -> bool:
    """Stages 1-2 in float32: the replicated master is also what forward
    reads; each device updates its shard of it, and the shards are
    all-gathered back after every update."""
    return self.stage in (1, 2) and not self.master_sharded

  @property
  def materialize(self) -> Materialize:
    """How forward gets each sharded parameter whole (see
    ``Materialize``)."""
    if self.stage < 2:
      return Materialize.LOCAL
    if self.stage == 2:
      return (Materialize.GATHER if self.keeps_gathered else
              Materialize.SCATTER)
    return (Materialize.GATHER if self.gather_from is GatherFrom.MASTER else
            Materialize.GATHER_FROM)

  @property
  def keeps_gathered(self) -> bool:
    """Stage 2 without a compute copy (FSDP's SHARD_GRAD_OP): forward
    gathers each layer of the fp32 master's shards, cast to the compute
    dtype, at first use (one layer ahead in a prefetched ``scan_layers``)
    and keeps it for backward, where the replicated copy would be
    all-gathered after each update with nothing to overlap."""
    return self.stage == 2 and self.gather_from is not None

  @property
  def gathers_from_host(self) -> bool:
    """Stage 3 gathers shards in host memory (``GatherFrom.from_host``)."""
    return self.gather_from is not None and self.gather_from.from_host

  @property
  def copy_dtype(self) -> np.dtype:
    """The compute copy's dtype."""
    return self.compute_dtype or jnp.dtype(jnp.float32)

  @property
  def host_grad_dtype(self) -> np.dtype | None:
    """With the update on the host, the 16-bit dtype gradients cross to it
    in (ZeRO-Offload's 2 bytes a parameter): a 16-bit ``reduce_dtype``,
    in which the sums of one micro-batch already are; over several,
    their float32 sum is rounded to it once. None: float32."""
    rd = self.reduce_dtype
    if (self.update is UpdateKind.HOST and rd is not None and
        np.dtype(rd).itemsize < 4):
      return np.dtype(rd)
    return None

  def describe(self) -> list[str]:
    """One line per decision, for ``Engine.describe()``."""
    q = self.quantize
    quantized = [what for on, what in (
        (q.weights, "parameter all-gathers (qwZ)"),
        (q.gradients, "gradient reductions of sharded leaves (qgZ)")) if on]
    # (First: the last line may introduce the streamed update's list.)
    return ([f"ZeRO++ int8 blocks of {q.block} (approximate): "
             + " and ".join(quantized)] if quantized else []) + self._where()

  def _where(self) -> list[str]:
    """Where each part of the state lives and the update runs."""
    dtype = self.compute_dtype.name if self.compute_dtype else "float32"
    if self.update is UpdateKind.HOST:
      lines = ["fp32 master and optimizer state: in host RAM, updated on "
               "the host (ZeRO-Offload; by which program: see below)",
               f"a {self.compute_copy.value} {dtype} copy for compute, in "
               f"{self.compute_memory.value} memory; gradients go to the "
               "host"
               + (f" in {self.host_grad_dtype.name} (reduce_dtype)"
                  if self.host_grad_dtype is not None else "")
               + ", the new copy comes back after each update"]
      if self.gather_from is GatherFrom.HOST_COMPUTE:
        lines.append("stage 3: each layer's shards of the copy are copied to "
                     "the device as forward and backward gather them")
      return lines
    master = "sharded" if self.master_sharded else "replicated"
    lines = [f"fp32 master: {master}, in {self.master_memory.value} memory; "
             f"optimizer state: sharded by shape, in "
             f"{self.opt_memory.value} memory"]
    if self.compute_copy is ComputeCopy.REPLICATED:
      lines.append(f"stages 1-2: a replicated {dtype} copy for compute, "
                   "all-gathered after each update")
    elif self.keeps_gathered:
      lines.append(f"stage 2: no {dtype} copy between steps; forward "
                   f"gathers each layer of the master's shards in {dtype} "
                   "and keeps it for backward (prefetch)")
    elif self.compute_copy is ComputeCopy.SHARDED:
      lines.append(f"stage 3: a sharded {dtype} copy on the device for "
                   "forward, refreshed after each update")
    elif self.stage in (1, 2):
      lines.append("stages 1-2: parameters replicated for compute; each "
                   "device updates only its shard")
    if self.gather_from is GatherFrom.HOST_MASTER:
      lines.append("stage 3: each layer's master shards are copied to the "
                   "device as forward and backward gather them")
    if self.grads_on_host:
      lines.append("gradient shards go to host memory as backward makes "
                   "them")
    lines.append({
        UpdateKind.DEVICE: "the optimizer update runs on the device",
        UpdateKind.STREAMED: "the update streams offloaded state through "
                             "the device slice by slice (leaves cut along "
                             "their first axis):",
        UpdateKind.HOST: "the optimizer update runs on the host"}[
                             self.update])
    return lines
