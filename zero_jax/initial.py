"""The initial state, built from the caller's parameters in the engine's
layout (whole, streamed slice by slice, or on the host's CPU devices), and
a restored state completed with what a checkpoint does not store.

These are the ``Engine``'s own parts: they read the layout it built
(``engine._streamer``, ``engine._host``...).
"""
# pylint: disable=protected-access

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from zero_jax import loss_scale as _ls, update
from zero_jax.state import (TrainState, compute_copy, device_part, on_device,
                            on_host)


def initializer(engine, params: Any
                ) -> tuple[Callable[..., TrainState], tuple]:
  """The jitted function ``init`` runs, and its arguments as
  ``jax.ShapeDtypeStruct`` trees with shardings: the placed parameters,
  then (streamed init) host buffers for the master and optimizer state
  (None where the buffer is made on the device or not needed)."""
  pl = engine.placement
  sh = engine.state_shardings
  sds = lambda x, s, dt=None: jax.ShapeDtypeStruct(x.shape, dt or x.dtype,
                                                   sharding=s)
  if engine._streamer is not None:
    host = lambda s: s.memory_kind == "pinned_host"
    where = (on_host(engine.param_plan.shardings) if pl.master_on_host
             else engine.param_plan.shardings)
    placed = jax.tree.map(sds, params, where)
    master = [sds(x, s, jnp.float32) if host(s) and x.dtype != jnp.float32
              else None for x, s in zip(jax.tree.leaves(params),
                                        jax.tree.leaves(where))]
    opt = jax.eval_shape(engine.tx.init, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), params))
    opt = [sds(x, s) if host(s) else None for x, s in
           zip(jax.tree.leaves(opt), jax.tree.leaves(sh.opt_state))]
    # (The placed copy is ours; it becomes the master where the layouts
    # agree: stage 3, or stages 1-2 with a compute copy.)
    donate = (0, 1, 2) if pl.master_sharded else (1, 2)
    return jax.jit(functools.partial(streamed_make_state, engine),
                   out_shardings=sh, donate_argnums=donate), (placed, master,
                                                              opt)
  if pl.master_on_host:
    # Placed in host memory first, so that no device ever holds a full
    # copy; the state is then built from device copies of the shards and
    # written back to the host by out_shardings. (Not compute_on: XLA
    # aborts compiling a compute_on'd init for GPUs.)
    to_device = on_device(engine._device_params)
    return jax.jit(lambda p: make_state(engine, jax.device_put(p, to_device)),
                   out_shardings=sh), (jax.tree.map(sds, params, sh.params),)
  # Straight into the final layout: no device ever holds a full copy of a
  # sharded leaf.
  return (jax.jit(functools.partial(make_state, engine), out_shardings=sh),
          (jax.tree.map(sds, params, engine._device_params),))


def host_state(engine, params: Any) -> TrainState:
  """The initial state with update_on="host": master and optimizer state
  built on the host's CPU devices, the compute copy sent to the device."""
  pl = engine.placement
  host = engine._host
  master = jax.jit(lambda p: jax.tree.map(
      lambda x: x.astype(jnp.float32), p),
                   out_shardings=host.master_shardings)(host.put(params))
  rest = jax.jit(lambda: TrainState(
      step=jnp.zeros((), jnp.int32), params=None, opt_state=None,
      rng=jax.random.PRNGKey(engine.config.seed),
      loss_scale=_ls.init(engine.config) if pl.counts_skips else None),
                 out_shardings=dataclasses.replace(
                     device_part(engine.state_shardings),
                     compute_params=None))()
  return dataclasses.replace(rest, params=master,
                             opt_state=host.init(master),
                             compute_params=host_copy(engine, master))


def host_copy(engine, master: Any) -> Any:
  """The compute copy, cast from the host's master, on the device."""
  copy = jax.jit(lambda m: jax.tree.map(
      lambda x: x.astype(engine.placement.copy_dtype), m),
                 out_shardings=engine._host.master_shardings)(master)
  return jax.device_put(copy, engine.state_shardings.compute_params)


def streamed_make_state(engine, params: Any, master: list,
                        opt: list) -> TrainState:
  """The initial state, built slice by slice (``zero_jax.stream``)."""
  pl = engine.placement
  cd = pl.compute_dtype if pl.compute_copy else None
  flat = jax.tree.leaves(params)
  shards = jax.tree.leaves(engine.param_plan.shardings)
  device_zeros = lambda shape, dtype, s: jax.lax.with_sharding_constraint(
      jnp.zeros(shape, dtype), s)
  master = [p if p.dtype == jnp.float32 else
            b if b is not None else device_zeros(p.shape, jnp.float32, s)
            for p, b, s in zip(flat, master, shards)]
  opt_shapes = jax.tree.leaves(jax.eval_shape(
      engine.tx.init, jax.tree.unflatten(jax.tree.structure(params), master)))
  opt = [b if b is not None else device_zeros(x.shape, x.dtype, s)
         for b, x, s in zip(opt, opt_shapes,
                            jax.tree.leaves(engine._device_opt))]
  compute = (None if cd is None else
             [device_zeros(p.shape, cd, s) for p, s in zip(flat, shards)])
  master, opt_state, compute = engine._streamer.init(
      flat, master, opt, master_on_host=pl.master_on_host,
      opt_on_host=pl.opt_on_host,
      compute_dtype=cd, compute=compute)
  compute_params = None
  if compute is not None:
    compute_params = jax.tree.unflatten(jax.tree.structure(master), compute)
    if pl.compute_copy == "replicated":
      compute_params = update.gather_replicated(engine.param_plan,
                                                compute_params)
  elif pl.master_regathered:
    # fp32: the master replicated
    master = update.gather_replicated(engine.param_plan, master)
  return TrainState(step=jnp.zeros((), jnp.int32), params=master,
                    opt_state=opt_state,
                    rng=jax.random.PRNGKey(engine.config.seed),
                    compute_params=compute_params,
                    loss_scale=(_ls.init(engine.config) if pl.counts_skips
                                else None))


def make_state(engine, params: Any) -> TrainState:
  """The initial state from parameters already in the master's layout (any
  floating dtype): cast to the fp32 master, ``tx.init`` on it."""
  pl = engine.placement
  master = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  return TrainState(step=jnp.zeros((), jnp.int32), params=master,
                    opt_state=engine.tx.init(master),
                    rng=jax.random.PRNGKey(engine.config.seed),
                    compute_params=compute_copy(pl, master),
                    loss_scale=(_ls.init(engine.config) if pl.counts_skips
                                else None))


def complete(engine, state: TrainState) -> TrainState:
  """Fills in what a checkpoint does not store: the compute copy (a cast
  of the master) and, for float16, a loss scale if the checkpoint had
  none."""
  pl = engine.placement
  sh = engine.state_shardings
  compute = loss_scale = None
  if engine._host is not None:
    compute = host_copy(engine, state.params)
  elif sh.compute_params is not None:
    def cast(master):
      # (An offloaded master is cast on the device, shard by shard.)
      return compute_copy(pl, jax.device_put(
          master, on_device(engine.param_plan.shardings)))
    compute = jax.jit(cast, out_shardings=sh.compute_params)(state.params)
  if pl.counts_skips:
    loss_scale = state.loss_scale
    if loss_scale is None:
      loss_scale = jax.jit(lambda: _ls.init(engine.config),
                           out_shardings=sh.loss_scale)()
  return dataclasses.replace(state, compute_params=compute,
                             loss_scale=loss_scale)
