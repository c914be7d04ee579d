"""The jitted train step: a function of the layout, the loss, the state and
the batch, as MaxText writes ``train_step``.

First half, the same for every layout: per-device loss and gradients,
reduced into the ZeRO layout inside ``shard_map`` (``_grads``). Second
half: the layout's update strategy (``_update``, ``_offloaded``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from zero_jax.train import _global, _grads
from zero_jax.train._state import TrainState
from zero_jax.train._step_plan import StepPlan
from zero_jax.train._update import StepOutputs


def train_step(layout: StepPlan, loss: _grads.Loss, state: TrainState,
               batch: Any, *, seen: dict[str, int] | None = None
               ) -> StepOutputs:
  """One step's ``StepOutputs`` (the new state, the metrics, and what the
  update strategy reads after it).

  ``overflow_at_min`` is the flag ``Engine.step`` raises on (None without
  float16 loss scaling). With update_on="host" this is the device's part:
  the state without master and optimizer state, and ``grads`` for the
  host's update.

  Args:
    layout: the ``StepPlan``.
    loss: what is trained.
    state: the state (as ``layout.update.device_input`` gives it).
    batch: the global batch, laid out as ``layout.batch.sharding``.
    seen: filled while tracing with the blocks run one at a time.
  """
  for x in jax.tree.leaves(batch):
    layout.batch.check(x.shape, x.shape[0] if x.ndim else None)
  rng = jax.random.fold_in(state.rng, state.step)
  scale = (state.loss_scale.scale if layout.placement.loss_scaling
           else None)
  grads_of = (_global.loss_and_grads if layout.decisions.global_loss else
              _grads.loss_and_grads)
  grads, value, aux = grads_of(layout, loss, state.params,
                               state.compute_params, batch, rng, scale, seen)
  metrics = {"loss": value}
  if loss.has_aux:
    metrics["aux"] = aux
  return layout.update.finish(layout, state, grads, metrics)


def jit_step(layout: StepPlan, loss: _grads.Loss,
             seen: dict[str, int] | None = None) -> Any:
  """The ``jax.jit`` of ``train_step`` for ``layout`` (traced anew: the
  layout's remat policy is read when it is traced)."""
  return layout.update.jit(
      layout, functools.partial(train_step, layout, loss, seen=seen))
