"""Dynamic loss scaling for float16 training, with DeepSpeed's rules.

float16 gradients underflow to zero below 6e-8, so the loss is multiplied by
a large scale before backward and the gradients divided by it after. The
scale is adapted as DeepSpeed's ``DynamicLossScaler`` does:

- it starts at ``2**initial_scale_power``;
- a step whose gradients hold an inf or nan (on any device) is skipped, and
  uses up one unit of ``hysteresis``; once none is left, the scale halves
  (never below ``min_loss_scale``);
- after ``loss_scale_window`` clean steps since the last overflow the scale
  doubles (and, unless ``consecutive_hysteresis``, the hysteresis refills);
- an overflow with the scale already at its minimum and no hysteresis left
  means training has diverged: flagged, and raised by ``engine.step``.

A static scale (``loss_scale > 0``) never changes, but overflowing steps are
still skipped.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from zero_jax.config import LossScaling
from zero_jax.layout import Decisions


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LossScaleState:
  """The loss scale and its counters; all replicated scalars.

  Attributes:
    scale: the scale the next step multiplies the loss by (float32).
    good_steps: clean steps since the last overflow (int32).
    hysteresis: overflows still tolerated before the scale halves (int32;
      at least 1 with float16, 0 in a state that only counts skips).
    skipped: steps skipped for overflow since training started (int32).
  """

  scale: jax.Array
  good_steps: jax.Array
  hysteresis: jax.Array
  skipped: jax.Array


def init(decisions: Decisions) -> LossScaleState:
  """The state before the first step. Without float16 only the skip count
  is kept: the scale is 1 and the hysteresis 0, which no float16 state has
  (it marks the state as a skip count, e.g. in a checkpoint)."""
  s = decisions.loss_scaling
  if not decisions.placement.loss_scaling:
    scale, hysteresis = 1.0, 0
  else:
    scale = s.scale if s.scale > 0 else 2.0 ** s.initial_power
    hysteresis = s.hysteresis
  return LossScaleState(scale=jnp.asarray(scale, jnp.float32),
                        good_steps=jnp.zeros((), jnp.int32),
                        hysteresis=jnp.asarray(hysteresis, jnp.int32),
                        skipped=jnp.zeros((), jnp.int32))


def update(state: LossScaleState, finite: jax.Array,
           rules: LossScaling) -> tuple[LossScaleState, jax.Array]:
  """The state after a step whose gradients were ``finite`` (or not).

  Args:
    state: the state the step used.
    finite: scalar bool, whether every gradient element on every device was
      finite.
    rules: the rules' constants.

  Returns:
    ``(new_state, overflow_at_min)``: the latter is True when the step
    overflowed with the scale already at ``min_loss_scale`` and no
    hysteresis left (DeepSpeed raises there).
  """
  overflow = jnp.logical_not(finite)
  skipped = state.skipped + overflow.astype(jnp.int32)
  if rules.scale > 0:  # static
    return dataclasses.replace(state, skipped=skipped), jnp.array(False)
  full = jnp.asarray(rules.hysteresis, jnp.int32)
  min_scale = jnp.float32(rules.min_scale)
  shift = state.hysteresis <= 1
  at_min = overflow & shift & (state.scale <= min_scale)
  # Overflow: spend hysteresis, or halve once it is spent.
  o_scale = jnp.where(shift, jnp.maximum(state.scale / 2, min_scale),
                      state.scale)
  o_hyst = jnp.where(shift, state.hysteresis, state.hysteresis - 1)
  # Clean step: double after a window of them.
  good = state.good_steps + 1
  double = good % rules.window == 0
  c_scale = jnp.where(double, state.scale * 2, state.scale)
  c_hyst = (full if rules.consecutive_hysteresis else
            jnp.where(double, full, state.hysteresis))
  new = LossScaleState(
      scale=jnp.where(overflow, o_scale, c_scale),
      good_steps=jnp.where(overflow, 0, good),
      hysteresis=jnp.where(overflow, o_hyst, c_hyst),
      skipped=skipped)
  return new, at_min
