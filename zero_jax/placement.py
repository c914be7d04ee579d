"""Where each part of the ZeRO state lives, and where the update runs.

One object, decided once from the config: the engine lays out and updates
the state by it, ``estimate_memory`` counts bytes by it, and
``Engine.describe()`` prints it. The rules:

- the fp32 master is sharded at stage 3, and at stages 1-2 when forward
  reads a separate compute-dtype copy; otherwise it is replicated (stage 0,
  and stages 1-2 in fp32, where the replicated compute copy *is* the
  master and each device updates the slice it owns);
- a separate compute copy exists at stages 1-2 with a ``compute_dtype``
  (replicated, refreshed by an all-gather after each update), and at stage
  3 with a ``compute_dtype`` when the master is offloaded but the
  parameters are not (sharded, refreshed by a cast);
- offload puts the optimizer state in pinned host memory, and the master
  too wherever forward does not read it (it reads the compute copy), or at
  stage 3 with ``offload_params`` (forward copies each layer's master
  shards to the device as it gathers them);
- offloaded state is updated by streaming it through the device a slice at
  a time (``zero_jax.stream``);
- with ``update_on="host"`` (ZeRO-Offload's split) master and optimizer
  state live on the host's CPU devices and a program of their own updates
  them there (``zero_jax.host_update``); the device keeps a compute copy
  (in the compute dtype, else float32: sharded at stage 3, replicated
  below; in pinned host memory with ``offload_params``, gathered layer by
  layer) and sends gradients to the host.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

DEVICE, HOST = "device", "pinned_host"
# Arrays on the host's CPU devices (update_on="host"): host RAM, outside the
# accelerator's programs.
CPU = "cpu"


@dataclasses.dataclass(frozen=True)
class Placement:
  """The layout decisions of one ``ZeroConfig``.

  Attributes:
    stage: the ZeRO stage.
    compute_dtype: dtype of forward and backward (None: float32).
    reduce_dtype: dtype gradients are summed in across devices (None: as
      computed, float32).
    master_sharded: the fp32 master is sharded (else replicated).
    master_memory: ``"device"``, ``"pinned_host"`` or ``"cpu"`` (on the
      host's CPU devices, ``update_on="host"``).
    opt_memory: the optimizer state's memory kind.
    compute_copy: ``None``, ``"replicated"`` or ``"sharded"``: the separate
      compute-dtype copy forward reads.
    compute_memory: the compute copy's memory kind.
    gather_from: stage 3: what parameters are gathered from:
      ``"master"`` (the fp32 shards), ``"compute"`` (the sharded compute
      copy), ``"host_master"`` (the offloaded master, copied to the
      device layer by layer) or ``"host_compute"`` (the compute copy in
      pinned host memory, likewise); None at stages 0-2.
    update: ``"device"`` (whole, on device-resident state), ``"streamed"``
      (offloaded state, slice by slice) or ``"host"`` (a program of its
      own on the host's CPU devices).
    grads_on_host: stage 3 with offloaded, streamed state (or the update
      on the host) and one micro-batch per step: each gradient shard goes
      to host memory as backward makes it (ZeRO-Offload), and the update
      reads it from there.
    loss_scaling: float16 loss scaling is on.
    counts_skips: the state keeps a ``LossScaleState`` (loss scaling, or
      ``skip_nonfinite``, where its scale stays 1): its ``skipped`` count
      says how many updates were applied, which is where the learning rate
      schedule is.
  """

  stage: int
  compute_dtype: np.dtype | None
  reduce_dtype: np.dtype | None
  master_sharded: bool
  master_memory: str
  opt_memory: str
  compute_copy: str | None
  gather_from: str | None
  update: str
  loss_scaling: bool
  grads_on_host: bool = False
  compute_memory: str = DEVICE
  counts_skips: bool = False

  @classmethod
  def of(cls, config, grad_accum_steps: int = 1) -> "Placement":
    """The placement a ``ZeroConfig`` asks for (with this many
    micro-batches per step: an accumulator stays on the device)."""
    cd = config.compute_dtype
    cd = None if cd in (None, "float32") else jnp.dtype(cd)
    rd = config.reduce_dtype
    # Gradients are summed in fp32 unless asked otherwise (see ZeroConfig).
    rd = (jnp.dtype(rd) if rd is not None else
          jnp.dtype(jnp.float32) if cd is not None else None)
    stage = config.stage
    offload_opt = config.offload_optimizer == "host"
    offload_params = bool(config.offload_params)
    compute_copy = None
    if stage in (1, 2) and cd is not None:
      compute_copy = "replicated"
    elif stage == 3 and cd is not None and offload_opt and not offload_params:
      compute_copy = "sharded"
    master_on_host = offload_params or (offload_opt and
                                        compute_copy is not None)
    gather_from = None
    if stage == 3:
      gather_from = ("host_master" if offload_params else
                     "compute" if compute_copy else "master")
    offloaded = offload_opt or offload_params
    counts_skips = (config.compute_dtype == "float16" or
                    config.skip_nonfinite)
    if config.update_on == "host":
      # ZeRO-Offload's split: the device only ever holds the compute copy.
      return cls(stage=stage, compute_dtype=cd, reduce_dtype=rd,
                 master_sharded=stage > 0, master_memory=CPU,
                 opt_memory=CPU,
                 compute_copy="sharded" if stage == 3 else "replicated",
                 compute_memory=HOST if offload_params else DEVICE,
                 gather_from=(None if stage != 3 else "host_compute"
                              if offload_params else "compute"),
                 update="host", loss_scaling=config.compute_dtype == "float16",
                 counts_skips=counts_skips,
                 grads_on_host=stage == 3 and grad_accum_steps == 1)
    update = "streamed" if offloaded else "device"
    return cls(stage=stage, compute_dtype=cd, reduce_dtype=rd,
               master_sharded=stage == 3 or compute_copy == "replicated",
               master_memory=HOST if master_on_host else DEVICE,
               opt_memory=HOST if offload_opt else DEVICE,
               compute_copy=compute_copy, gather_from=gather_from,
               update=update,
               loss_scaling=config.compute_dtype == "float16",
               counts_skips=counts_skips,
               grads_on_host=(gather_from in ("compute", "host_master")
                              and update == "streamed"
                              and grad_accum_steps == 1))

  @property
  def master_on_host(self) -> bool:
    """The master lives outside device memory (pinned host or CPU)."""
    return self.master_memory in (HOST, CPU)

  @property
  def opt_on_host(self) -> bool:
    """The optimizer state lives outside device memory."""
    return self.opt_memory in (HOST, CPU)

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
  def materialize(self) -> str:
    """How forward gets each sharded parameter whole, and where its
    gradient goes (``zero_jax.materialize``): ``"local"`` (stages 0-1: the
    parameters are whole already; gradients are reduced after backward),
    ``"scatter"`` (stage 2: the replicated copy is used, and its gradient
    reduce-scattered as backward makes it), ``"gather"`` (stage 3 from the
    fp32 master shards, differentiated themselves) or ``"gather_from"``
    (stage 3 from another copy: the sharded compute copy or host memory;
    the gradient goes to a zero-valued stand-in of the shard)."""
    if self.stage < 2:
      return "local"
    if self.stage == 2:
      return "scatter"
    return "gather" if self.gather_from == "master" else "gather_from"

  @property
  def gathers_from_host(self) -> bool:
    """Stage 3 gathers shards in host memory: each is copied to the device
    (one layer at a time inside a scan) before the all-gather."""
    return self.gather_from in ("host_master", "host_compute")

  @property
  def copy_dtype(self) -> np.dtype:
    """The compute copy's dtype."""
    return self.compute_dtype or jnp.dtype(jnp.float32)

  def describe(self) -> list[str]:
    """One line per decision, for ``Engine.describe()``."""
    dtype = self.compute_dtype.name if self.compute_dtype else "float32"
    if self.update == "host":
      copy = "sharded" if self.compute_copy == "sharded" else "replicated"
      lines = ["fp32 master and optimizer state: in host RAM, split over "
               "the host's CPU devices, updated there by a program of their "
               "own (ZeRO-Offload)",
               f"a {copy} {dtype} copy for compute, in {self.compute_memory} "
               "memory; gradients go to the host, the new copy comes back "
               "after each update"]
      if self.gather_from == "host_compute":
        lines.append("stage 3: each layer's shards of the copy are copied to "
                     "the device as forward and backward gather them")
      return lines
    master = "sharded" if self.master_sharded else "replicated"
    lines = [f"fp32 master: {master}, in {self.master_memory} memory; "
             f"optimizer state: sharded by shape, in {self.opt_memory} "
             "memory"]
    if self.compute_copy == "replicated":
      lines.append(f"stages 1-2: a replicated {dtype} copy for compute, "
                   "all-gathered after each update")
    elif self.compute_copy == "sharded":
      lines.append(f"stage 3: a sharded {dtype} copy on the device for "
                   "forward, refreshed after each update")
    elif self.stage in (1, 2):
      lines.append("stages 1-2: parameters replicated for compute; each "
                   "device updates only its shard")
    if self.gather_from == "host_master":
      lines.append("stage 3: each layer's master shards are copied to the "
                   "device as forward and backward gather them")
    if self.grads_on_host:
      lines.append("gradient shards go to host memory as backward makes "
                   "them")
    lines.append({
        "device": "the optimizer update runs on the device",
        "streamed": "the update streams offloaded state through the device "
                    "slice by slice (leaves cut along their first axis):",
        "host": "the optimizer update runs on the host"}[self.update])
    return lines
