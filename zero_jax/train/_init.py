"""The first state, built from the caller's parameters in the layout, and a
restored state completed with what a checkpoint does not store.

The strategies of the update (``zero_jax.train._update``) choose among
these: the whole state built in its final layout here, or streamed slice
by slice, or on the host's CPU devices (``zero_jax.train._offloaded``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax.train import _loss_scale
from zero_jax.train._state import TrainState, compute_copy, on_device

if TYPE_CHECKING:  # (the plan's module imports this one)
  from zero_jax.train._step_plan import StepPlan


def shape_of(x: Any, sharding: Any, dtype: Any = None
             ) -> jax.ShapeDtypeStruct:
  """``x``'s shape (in ``dtype``, else its own) laid out by ``sharding``."""
  return jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=sharding)


def first_loss_scale(layout: StepPlan) -> Any:
  """The ``LossScaleState`` of a fresh run, or None where the placement
  keeps none."""
  return (_loss_scale.init(layout.decisions) if layout.placement.counts_skips
          else None)


def make_state(layout: StepPlan, params: Any) -> TrainState:
  """The initial state from parameters already in the master's layout (any
  floating dtype): cast to the fp32 master, ``tx.init`` on it."""
  master = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  return TrainState(step=jnp.zeros((), jnp.int32), params=master,
                    opt_state=layout.tx.init(master),
                    rng=jax.random.PRNGKey(layout.decisions.seed),
                    compute_params=compute_copy(layout.placement, master),
                    loss_scale=first_loss_scale(layout))


def whole_initializer(layout: StepPlan, params: Any
                      ) -> tuple[Callable[..., TrainState], tuple]:
  """``make_state`` jitted straight into the final layout (no device ever
  holds a full copy of a sharded leaf), and its argument's shapes."""
  return (jax.jit(lambda p: make_state(layout, p),
                  out_shardings=layout.state_shardings),
          (jax.tree.map(shape_of, params, layout.device_params),))


def _buffers(x: Any) -> list[tuple[int, int]] | None:
  """The memory ranges ``(start, end)`` that ``x``'s data occupies in this
  process (a jax.Array's shards, a numpy array's buffer), or None where
  they cannot be told."""
  try:
    if isinstance(x, jax.Array):
      return [(p, p + s.data.nbytes) for s in x.addressable_shards
              if (p := s.data.unsafe_buffer_pointer())]
    x = np.asarray(x)
    start = x.__array_interface__["data"][0]
    return [(start, start + max(x.nbytes, 1))]
  except Exception:  # pylint: disable=broad-except
    return None  # (an array of another kind, a backend without pointers)


def _shares(x: Any, copy: jax.Array) -> bool:
  """Whether ``copy``, placed from ``x``, still holds memory of ``x``'s;
  True where that cannot be told."""
  theirs, ours = _buffers(x), _buffers(copy)
  if theirs is None or ours is None:
    return True
  return any(a < d and c < b for a, b in theirs for c, d in ours)


def fresh(params: Any, placed_params: Any) -> Any:
  """``placed_params`` (``params`` placed by ``jax.device_put``), with
  every leaf that shares memory with the caller's leaf copied.

  ``device_put(..., may_alias=False)`` is not enough, on any supported jax:
  a leaf on one device placed replicated keeps the caller's buffer as that
  device's copy, and a small numpy array on a CPU device is used in place.
  The state is donated to every step (and the placed parameters to a
  streamed init), which would delete or overwrite the caller's arrays.
  """
  theirs, treedef = jax.tree.flatten(params)
  ours = treedef.flatten_up_to(placed_params)
  shared = [i for i, (x, y) in enumerate(zip(theirs, ours)) if _shares(x, y)]
  in_device = [i for i in shared
               if (ours[i].sharding.memory_kind or "device") == "device"]
  if in_device:
    # One program copies them all (a jit output never aliases an input
    # that is not donated).
    copies = jax.jit(lambda xs: [jnp.copy(x) for x in xs],
                     out_shardings=[ours[i].sharding for i in in_device])(
                         [ours[i] for i in in_device])
    for i, c in zip(in_device, copies):
      ours[i] = c
  for i in set(shared) - set(in_device):
    # (Host memory: through the device and back, two fresh buffers.)
    sh = ours[i].sharding
    ours[i] = jax.device_put(
        jax.device_put(ours[i], sh.with_memory_kind("device")), sh)
  return treedef.unflatten(ours)


def placed(layout: StepPlan, params: Any, make: Callable[..., TrainState],
           args: tuple) -> TrainState:
  """Runs an initializer (``make`` with arguments shaped as ``args``):
  ``params`` copied into the layout of ``args[0]``, and the buffers of the
  others (host memory a streamed init writes into) made where they live."""
  del layout
  # Always a copy: later steps donate the state (a streamed init the placed
  # parameters), and that must never invalidate the caller's arrays.
  placed_params = fresh(params, jax.device_put(
      params, jax.tree.map(lambda a: a.sharding, args[0]), may_alias=False))
  # Zeros in host memory come from numpy, shard by shard, never through a
  # device.
  zeros = lambda a: None if a is None else jax.make_array_from_callback(
      a.shape, a.sharding, lambda idx: np.zeros(
          a.sharding.shard_shape(a.shape), a.dtype))
  buffers = jax.tree.map(zeros, args[1:], is_leaf=lambda a: a is None)
  return make(placed_params, *buffers)


def cast_copy(layout: StepPlan, master: Any) -> Any:
  """The compute copy cast from a (restored) master, on the device; None
  where the layout keeps none."""
  sh = layout.state_shardings
  if sh.compute_params is None:
    return None

  def cast(master):
    # (An offloaded master is cast on the device, shard by shard.)
    return compute_copy(layout.placement, jax.device_put(
        master, on_device(layout.param_plan.shardings)))

  return jax.jit(cast, out_shardings=sh.compute_params)(master)


def complete(layout: StepPlan, state: TrainState) -> TrainState:
  """Fills in what a checkpoint does not store: the compute copy (a cast
  of the master), and the loss scale of this layout: the stored one where
  it is a float16 run's and this layout scales the loss, else a fresh one
  that carries the stored skip count."""
  pl = layout.placement
  sh = layout.state_shardings
  loss_scale = None
  if pl.counts_skips:
    loss_scale = state.loss_scale
    fresh = jax.jit(lambda: first_loss_scale(layout),
                    out_shardings=sh.loss_scale)
    if loss_scale is None:
      loss_scale = fresh()
    elif not (pl.loss_scaling and int(loss_scale.hysteresis) > 0):
      # Only a float16 run's scale is a loss scale (elsewhere it stays 1,
      # with hysteresis 0): the skip count carries over, the scale starts
      # afresh.
      loss_scale = dataclasses.replace(fresh(), skipped=jax.device_put(
          loss_scale.skipped, sh.loss_scale.skipped))
  state = layout.update.adopt(state)
  return dataclasses.replace(
      state, compute_params=layout.update.compute_copy(layout, state.params),
      loss_scale=loss_scale)
