"""The update strategies of offloaded state (``zero_jax.train._update``).

``Streamed``: master and optimizer state in pinned host memory, streamed
through the device a slice at a time by an ``offload.Streamer`` (the
first state too). ``OnHost``: ZeRO-Offload's split; master and optimizer
state on the host's CPU devices, updated there by an ``offload.HostUpdate``
program of their own; the device's step only computes gradients and the
new compute copy comes back after the update.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax import offload
from zero_jax.layout import (DATA, MODEL, ComputeCopy, GatherFrom, LeafPlan,
                             UpdateKind)
from zero_jax.layout._plan import flat, map_leaves
from zero_jax.materialize._collectives import gather_replicated
from zero_jax.train import _init
from zero_jax.train._state import TrainState, device_part, on_host
from zero_jax.train._update import (OnDevice, StepOutputs,
                                    compiler_options, grad_shardings,
                                    injected_learning_rate, new_state,
                                    prepare)

if TYPE_CHECKING:  # (the plan's module imports this one)
  from zero_jax.train._step_plan import StepPlan


def _device_zeros(shape: tuple, dtype: Any, sharding: Any) -> jax.Array:
  return jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), sharding)


@dataclasses.dataclass(frozen=True, eq=False)
class Streamed(OnDevice):
  """Offloaded state updated on the device, slice by slice: ``OnDevice``'s
  jitted step and host side, with the update and the first state built a
  slice at a time.

  Attributes:
    streamer: how the state is cut into slices.
  """

  streamer: offload.Streamer
  kind = UpdateKind.STREAMED

  def finish(self, layout: StepPlan, state, grads, metrics):
    pl = layout.placement
    # Gradients in host memory are read a slice at a time.
    prepared = prepare(layout, grads, state.step, state.loss_scale,
                       self.streamer.grad_stats if pl.grads_on_host
                       else None)
    metrics.update(prepared.metrics)
    cd = pl.compute_dtype if pl.compute_copy else None
    shards = grad_shardings(layout)
    master = state.params
    if not pl.master_on_host:
      # (Stages 1-2 with fp32 compute: slicing the replicated master to its
      # shard is local, no communication.)
      master = jax.device_put(master, shards)
    compute = None
    if pl.compute_copy is ComputeCopy.SHARDED:
      compute = jax.tree.leaves(state.compute_params)
    elif cd is not None:
      compute = [_device_zeros(x.shape, cd, sh) for x, sh in
                 zip(jax.tree.leaves(master), jax.tree.leaves(shards))]
    master, opt_state, compute = self.streamer.update(
        prepared.grads, state.opt_state, master, finite=prepared.finite,
        master_on_host=pl.master_on_host, opt_on_host=pl.opt_on_host,
        compute_dtype=cd, compute=compute, grad_fn=prepared.grad_fn)
    device_master = (master if cd is None and not pl.master_on_host
                     else None)
    if compute is not None:
      device_master = jax.tree.unflatten(jax.tree.structure(master), compute)
    return new_state(layout, state, master, opt_state, device_master,
                     prepared, metrics)

  def initializer(self, layout: StepPlan, params):
    """The streamed init, and its arguments: the placed parameters, then
    host buffers for the master and optimizer state (None where the
    buffer is made on the device or not needed)."""
    pl = layout.placement
    sh = layout.state_shardings
    host = lambda s: s.memory_kind == "pinned_host"
    where = (on_host(layout.param_plan.shardings) if pl.master_on_host
             else layout.param_plan.shardings)
    placed = jax.tree.map(_init.shape_of, params, where)
    master = [_init.shape_of(x, s, jnp.float32)
              if host(s) and x.dtype != jnp.float32 else None
              for x, s in zip(jax.tree.leaves(params),
                              jax.tree.leaves(where))]
    opt = jax.eval_shape(layout.tx.init, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), params))
    opt = [_init.shape_of(x, s) if host(s) else None for x, s in
           zip(jax.tree.leaves(opt), jax.tree.leaves(sh.opt_state))]
    # (The placed copy is ours; it becomes the master where the layouts
    # agree: stage 3, or stages 1-2 with a compute copy.)
    donate = (0, 1, 2) if pl.master_sharded else (1, 2)
    return jax.jit(functools.partial(self._make_state, layout),
                   out_shardings=sh, donate_argnums=donate), (placed, master,
                                                              opt)

  def _make_state(self, layout: StepPlan, params: Any, master: list,
                  opt: list) -> TrainState:
    """The initial state, built slice by slice."""
    pl = layout.placement
    cd = pl.compute_dtype if pl.compute_copy else None
    flat = jax.tree.leaves(params)
    shards = jax.tree.leaves(layout.param_plan.shardings)
    master = [p if p.dtype == jnp.float32 else
              b if b is not None else _device_zeros(p.shape, jnp.float32, s)
              for p, b, s in zip(flat, master, shards)]
    opt_shapes = jax.tree.leaves(jax.eval_shape(
        layout.tx.init,
        jax.tree.unflatten(jax.tree.structure(params), master)))
    opt = [b if b is not None else _device_zeros(x.shape, x.dtype, s)
           for b, x, s in zip(opt, opt_shapes,
                              jax.tree.leaves(layout.device_opt))]
    compute = (None if cd is None else
               [_device_zeros(p.shape, cd, s) for p, s in zip(flat, shards)])
    master, opt_state, compute = self.streamer.init(
        flat, master, opt, master_on_host=pl.master_on_host,
        opt_on_host=pl.opt_on_host, compute_dtype=cd, compute=compute)
    compute_params = None
    if compute is not None:
      compute_params = jax.tree.unflatten(jax.tree.structure(master), compute)
      if pl.compute_copy is ComputeCopy.REPLICATED:
        compute_params = gather_replicated(layout.param_plan,
                                                       compute_params)
    elif pl.master_regathered:
      # fp32: the master replicated
      master = gather_replicated(layout.param_plan, master)
    return TrainState(step=jnp.zeros((), jnp.int32), params=master,
                      opt_state=opt_state,
                      rng=jax.random.PRNGKey(layout.decisions.seed),
                      compute_params=compute_params,
                      loss_scale=_init.first_loss_scale(layout))

  def traffic(self, layout: StepPlan) -> tuple[int, int]:
    """PCIe bytes per step and device, (to the device, to the host): the
    offloaded master and optimizer state come down slice by slice and go
    back; gradient shards kept in host memory go there once and come back
    twice (the global norm, then the update); with ``offload_params``
    forward and backward also gather their layers from the host master."""
    pl = layout.placement
    n, m = layout.mesh.shape[DATA], dict(layout.mesh.shape).get(MODEL, 1)
    master = [_per_device(lp, n, m) for lp in flat(layout.param_plan.leaves)]
    state = 4 * sum(master) if pl.master_on_host else 0
    if pl.opt_on_host:
      state += sum(_per_device(lp, n, m) * x.dtype.itemsize for lp, x in zip(
          flat(layout.opt_plan.leaves),
          jax.tree.leaves(layout.state_shapes.opt_state)))
    grads = 4 * sum(e for e, to_host in zip(master,
                                            layout.grads.grads_to_host)
                    if to_host)
    gathers = 0
    if pl.gather_from is GatherFrom.HOST_MASTER:
      gathers = 2 * 4 * sum(e for e, lp in zip(
          master, flat(layout.param_plan.leaves)) if lp.sharded)
    return state + 2 * grads + gathers, state + grads

  def describe(self, layout: StepPlan):
    down, up = self.traffic(layout)
    line = (f"streamed update: {down / 2**20:,.1f} MiB to the device and "
            f"{up / 2**20:,.1f} MiB to the host per step and device over "
            "PCIe (master and moments down and back, gradient shards in "
            "host memory read twice" + (
                ", layers gathered from the host master in forward and "
                "backward" if layout.placement.gather_from is
                GatherFrom.HOST_MASTER else "") +
            "); update_on='host' moves 4 to 6 bytes a parameter")
    return [line, *self.streamer.describe()]


@dataclasses.dataclass
class HostCarry:
  """What ``OnHost`` keeps from one step to the next. The ``StepFunction``
  holds it (and drops it on ``reset``: a new state, or a new layout);
  ``OnHost.after`` updates it in place.

  Attributes:
    pending: with ``delay_update``: (the master the last step returned,
      its compute copy still on the host's CPU devices), which the next
      step sends up; None otherwise.
    spare: the last compute copy sent to the device, whose host buffers
      the next update writes its copy into; taken (set to None) before the
      update, which donates it, so that a step that fails leaves no
      deleted buffer behind.
  """

  pending: tuple[Any, Any] | None = None
  spare: Any = None


@dataclasses.dataclass(frozen=True, eq=False)
class OnHost:
  """ZeRO-Offload's split: the update as a program of its own on the
  host's CPU devices.

  Attributes:
    host: the host's program and where its state lives.
  """

  host: offload.HostUpdate
  kind = UpdateKind.HOST
  # The host's update is jitted per prepare function: the current layout's,
  # made once ([layout, its prepare]; a new layout replaces it).
  _prepare_of: list = dataclasses.field(default_factory=lambda: [None, None],
                                        repr=False)

  def jit(self, layout: StepPlan, fn):
    # The device's program: gradients out for the host's update (in host
    # memory where backward sends them there). Nothing is donated: no
    # output takes an input's place; the step deletes the old compute copy
    # once this is dispatched.
    pl = layout.placement
    r = layout.replicated
    grads = grad_shardings(layout)
    if pl.grads_on_host:
      grads = map_leaves(
          lambda lp, s: s.with_memory_kind("pinned_host") if lp.sharded
          else s, layout.param_plan.leaves, grads)
    return jax.jit(fn, out_shardings=StepOutputs(
        dataclasses.replace(device_part(layout.state_shardings),
                            compute_params=None, loss_scale=None), r,
        grads=grads), compiler_options=compiler_options(layout))

  def finish(self, layout: StepPlan, state, grads, metrics):
    # The rest is the host's program: the gradients leave as the reduction
    # made them.
    del layout
    return StepOutputs(TrainState(step=state.step + 1, params=None,
                                  opt_state=None, rng=state.rng), metrics,
                       grads=grads)

  def device_input(self, state):
    return device_part(state)

  def after(self, layout: StepPlan, state, outputs, carry):
    """The host's update (dispatched asynchronously, like any jitted call),
    then the new compute copy sent to the device. ``carry``: the
    ``HostCarry`` this returned last (None at first), updated in place."""
    new, metrics, grads = outputs.state, outputs.metrics, outputs.grads
    carry = carry if carry is not None else HostCarry()
    sh = layout.state_shardings
    cd = layout.placement.copy_dtype
    # (Taken before the update, which donates it: a step that fails leaves
    # no deleted buffer behind for the next.)
    into, carry.spare = carry.spare, None
    if into is not None and not self.host.fits(into, cd):
      into = None
    # (The fused host optimizer runs in the background with delay_update:
    # its kernels overlap the device's next step. Without it each leaf's
    # compute copy goes up as soon as its kernel has written it.)
    how = ({} if not self.fused else
           {"background": True} if layout.decisions.delay_update else
           {"send": sh.compute_params})
    if self.fused:  # (what a tier on disk commits with the state)
      how["commit"] = lambda out: _kept(new.step, out[0])
    master, opt_state, copy, (loss_scale, more, at_min) = self.host.update(
        grads, state.params, state.opt_state,
        {"step": state.step, "loss_scale": state.loss_scale},
        prepare=self._prepare(layout), compute_dtype=cd, into=into,
        **how)
    metrics.update(more)
    lr = injected_learning_rate(opt_state)
    if lr is not None:
      # (On the host's CPU devices, or a copy of the host buffer the next
      # update overwrites.)
      metrics["learning_rate"] = np.array(lr) if self.fused else lr
    if loss_scale is not None:
      loss_scale = self.host.to_device(loss_scale, sh.loss_scale)
    to_device = lambda c: self.host.to_device(c, sh.compute_params)
    if "send" in how:
      compute, sent = copy, None  # (on the device already)
    elif not layout.decisions.delay_update:
      compute, sent = to_device(copy), copy
    else:
      # The next step reads the copy this step's update started from (made
      # by the last step's update, sent up now), not the one being made:
      # the device need not wait for the host, whose update of this step
      # runs while the device computes the next. (Only for the state the
      # last step returned; after init or a restore the state's own copy.)
      pending, carry.pending = carry.pending, (master, copy)
      sent = (pending[1] if pending and pending[0] is state.params
              else None)
      compute = (state.compute_params if sent is None
                 else to_device(sent))
    if compute is not state.compute_params:
      # The state is donated: its compute copy goes before the new one
      # comes, so the device holds no more copies than it must.
      for x in jax.tree.leaves(state.compute_params):
        x.delete()
    if sent is not None and _copied(sent, compute):
      # Its transfer is under way: the donation waits for it to finish.
      carry.spare = sent
    return dataclasses.replace(
        new, params=master, opt_state=opt_state, loss_scale=loss_scale,
        compute_params=compute), metrics, at_min, carry

  def _prepare(self, layout: StepPlan):
    if self._prepare_of[0] is not layout:
      self._prepare_of[:] = [layout, functools.partial(
          _host_scalars if self.fused else _host_prepare, layout)]
    return self._prepare_of[1]

  @property
  def fused(self) -> bool:
    """Whether the fused host optimizer runs the update."""
    return getattr(self.host, "fused", False)

  def adopt(self, state):
    if not self.fused:
      return state
    master, opt_state = self.host.adopt(
        state.params, state.opt_state,
        commit=_kept(state.step, state.loss_scale))
    return dataclasses.replace(state, params=master, opt_state=opt_state)

  def live(self, x):
    return self.fused and self.host.live(x)

  def initializer(self, layout: StepPlan, params):
    raise ValueError(
        "with update_on='host' the first state is built by several "
        "programs on the host's CPU devices and one copy to the device: "
        "there is no one init program to lower")

  def init(self, layout: StepPlan, params):
    """Master and optimizer state built on the host (by the fused host
    optimizer in its buffers, else on the host's CPU devices), the compute
    copy sent to the device."""
    host = self.host
    rest = jax.jit(lambda: TrainState(
        step=jnp.zeros((), jnp.int32), params=None, opt_state=None,
        rng=jax.random.PRNGKey(layout.decisions.seed),
        loss_scale=_init.first_loss_scale(layout)),
                   out_shardings=dataclasses.replace(
                       device_part(layout.state_shardings),
                       compute_params=None))()
    if self.fused:
      template = _kept(rest.step, rest.loss_scale)
      master, opt_state = host.init(params, commit=template)
      if host.resumed is not None:
        # (The NVMe tier resumed a committed step: its step and scale.)
        kept = jax.device_put(
            jax.tree.unflatten(jax.tree.structure(template), host.resumed),
            jax.tree.map(lambda x: x.sharding, template))
        rest = dataclasses.replace(rest, step=kept["step"],
                                   loss_scale=kept["loss_scale"])
    else:
      # (A copy the caller does not hold: the host's update donates it.)
      master = jax.jit(lambda p: jax.tree.map(
          lambda x: x.astype(jnp.float32), p),
                       out_shardings=host.master_shardings)(
                           _init.fresh(params, host.put(params)))
      opt_state = host.init(master)
    return dataclasses.replace(rest, params=master, opt_state=opt_state,
                               compute_params=self.compute_copy(layout,
                                                                master))

  def compute_copy(self, layout: StepPlan, master):
    """The compute copy, cast from the host's master, on the device."""
    if self.fused:
      return self.host.to_device(
          self.host.cast(master, layout.placement.copy_dtype),
          layout.state_shardings.compute_params)
    copy = jax.jit(lambda m: jax.tree.map(
        lambda x: x.astype(layout.placement.copy_dtype), m),
                   out_shardings=self.host.master_shardings)(master)
    return self.host.to_device(copy, layout.state_shardings.compute_params)

  def to_device(self, tree, shardings):
    return self.host.to_device(tree, shardings)

  def host_bytes(self, layout: StepPlan) -> int:
    """Host RAM the fused host optimizer holds (``FusedUpdate.host_bytes``);
    0 for the XLA:CPU program, whose state XLA allocates."""
    pl = layout.placement
    return self.host.host_bytes(
        pl.copy_dtype, pl.host_grad_dtype or np.float32,
        layout.decisions.delay_update) if self.fused else 0

  def traffic(self, layout: StepPlan) -> tuple[int, int]:
    """PCIe bytes per step, all devices together, (to the devices, to the
    host): one copy of each gradient leaf in the dtype backward sends it in
    (``Placement.host_grad_dtype``, else float32), and each device's part
    of the new compute copy (with ``offload_params`` it goes to host
    memory, from which forward and backward copy each layer in turn)."""
    pl = layout.placement
    shapes = [lp.shape for lp in flat(layout.param_plan.leaves)]
    grad = np.dtype(pl.host_grad_dtype or np.float32).itemsize
    copy = np.dtype(pl.copy_dtype).itemsize
    to_device = sum(s.mesh.size * math.prod(s.shard_shape(shape))
                    for s, shape in zip(jax.tree.leaves(
                        layout.state_shardings.compute_params), shapes))
    return copy * to_device, grad * sum(math.prod(x) for x in shapes)

  def describe(self, layout: StepPlan):
    down, up = self.traffic(layout)
    n = layout.mesh.size * sum(math.prod(lp.shape) for lp in flat(
        layout.param_plan.leaves))
    line = (f"{self.host.describe()}; per step {up / 2**20:,.1f} MiB of "
            f"gradients to the host and {down / 2**20:,.1f} MiB of compute "
            f"copy to the devices over PCIe ({(up + down) / n:.2f} bytes a "
            "parameter and device)")
    if self.fused:
      line += (f"; {self.host_bytes(layout) / 2**30:,.2f} GiB of host RAM "
               f"(the compute copy, the gradients, {self.host.in_ram})")
    else:
      line += ("; the update is one XLA:CPU program: the fused host "
               "optimizer runs zero_jax.offload's adamw, adam, lion, sgd and "
               "adagrad, and zj.initialize's optimizers but Lamb and "
               "AMSGrad, not this tx")
    return [line]


def _per_device(lp: LeafPlan, n: int, m: int) -> int:
  """Elements of a leaf each device holds."""
  return math.prod(lp.local_shape(n)) // (m if lp.model_split else 1)


def _kept(step: Any, loss_scale: Any) -> dict[str, Any]:
  """What a tier on disk commits with the state: the train state's step
  and loss scale."""
  return {"step": step, "loss_scale": loss_scale}


def _copied(host: Any, device: Any) -> bool:
  """Whether ``device`` is a copy of ``host`` that shares no buffer with it
  (no device in common; a mesh of CPU devices may be the host's own)."""
  return all(isinstance(h, jax.Array) and
             h.sharding.device_set.isdisjoint(d.sharding.device_set)
             for h, d in zip(jax.tree.leaves(host), jax.tree.leaves(device)))


def _host_scalars(layout: StepPlan, sumsq: jax.Array, extra: dict[str, Any]):
  """``prepare`` for the fused host optimizer (``FusedUpdate.update``'s):
  from the gradients' sum of squares, ``((divisor, clip, norm, c), finite,
  (loss scale, metrics, overflow at min))``: each gradient is divided by
  ``divisor`` (the loss scale), then, where ``clip``, by ``norm`` and
  times ``c`` (optax.clip_by_global_norm's formula)."""
  pl, c = layout.placement, layout.decisions.clip_grad_norm
  stats = lambda grads, unscale: (unscale(jnp.sqrt(sumsq)),
                                  jnp.isfinite(sumsq))
  p = prepare(layout, None, extra["step"], extra["loss_scale"], stats)
  norm = p.metrics["grad_norm"]
  divisor = (extra["loss_scale"].scale if pl.loss_scaling
             else jnp.float32(1))
  clip = jnp.logical_not(norm < c) if c is not None else jnp.bool_(False)
  return ((divisor, clip, norm, jnp.float32(1 if c is None else c)),
          p.finite, (p.loss_scale, p.metrics, p.overflow_at_min))


def _host_prepare(layout: StepPlan, grads: Any, extra: dict[str, Any]):
  """``prepare`` inside the host's update (``HostUpdate.update``'s
  ``prepare``): ``(grads, finite, (loss scale, metrics, overflow at
  min))``."""
  p = prepare(layout, grads, extra["step"], extra["loss_scale"])
  return p.grads, p.finite, (p.loss_scale, p.metrics, p.overflow_at_min)
