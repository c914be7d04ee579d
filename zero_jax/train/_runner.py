"""``engine.step``: the jitted train step and the host-side work around it:
checks of the state and batch it is given, the remat choice, the update
strategy's host side, and the overflow and skip flags read one step late.
"""

from __future__ import annotations

from typing import Any

from zero_jax import _heartbeat
from zero_jax.config import RematPolicy
from zero_jax.train import _checks
from zero_jax.train._state import TrainState
from zero_jax.train._train_step import jit_step


class StepFunction:
  """``engine.step``: the jitted train step plus batch placement.

  ``state, metrics = engine.step(state, batch)``. ``batch`` is a pytree of
  arrays whose leading dimension is the global batch (divisible by the
  number of devices); host (numpy) leaves are placed on the mesh first (in
  multi-process runs each process passes its own slice of the global
  batch). ``state`` is donated. ``metrics`` holds ``"loss"`` (the mean over
  the global batch), ``"grad_norm"`` (the global gradient norm over the
  whole model, before clipping), ``"learning_rate"`` (the rate of the last
  update applied) when ``tx`` was built with ``optax.inject_hyperparams``,
  with float16 loss scaling ``"loss_scale"`` (the scale this step used),
  ``"skipped"`` (this step overflowed and changed nothing but the scale)
  and ``"skipped_steps"`` (the running total); in fp32 and bf16 with
  ``skip_nonfinite`` (the default), ``"skipped"``: the gradient norm was
  NaN or inf, and the step changed nothing but the step counter and
  ``"skipped_steps"``, the running total; and, with ``has_aux``,
  ``"aux"``.

  An overflow at the minimum loss scale, or ``max_consecutive_skips``
  non-finite steps in a row, means training has diverged: the next call
  raises ``FloatingPointError`` (checked one step late, so the host never
  waits for the step it has just dispatched).

  Before anything reaches XLA, ``state`` is checked (not donated to an
  earlier step; this engine's tree, shapes, dtypes and devices: a state of
  another engine is converted by saving and restoring it through
  ``Checkpointer``), and so is ``batch`` (one leading dimension, not zero).

  ``engine.step.lower(state, batch)`` returns the jitted step's
  ``Lowered``, so ``.compile()`` gives the compiled step for memory and HLO
  analysis; ``engine.step.jitted`` is the raw ``jax.jit`` function. Both
  return ``(state, metrics, overflow_at_min)``: the third output is
  internal, the flag this wrapper raises on (None without float16 loss
  scaling). (With ``update_on="host"`` the jitted function is the device's
  program: it takes the state without ``params`` and ``opt_state``, and
  returns the gradients for the host's update beside the state and
  metrics.)
  """

  def __init__(self, engine):
    self._engine = engine
    self._jit: tuple[Any, Any] = (None, None)  # (layout, its jax.jit)
    self._at_min = None  # the previous step's overflow-at-minimum flag
    self._skipped = []  # skip flags (non-finite norm) not yet read
    self._skips = 0  # skipped steps in a row, up to the previous one
    self._returned = None  # the state the previous step returned
    self._carry = None  # what the update strategy keeps between steps

  def reset(self) -> None:
    """Forgets what the update strategy carried between steps (the engine
    was laid out anew)."""
    self._carry = None
    self._returned = None

  def jit_for(self, layout) -> Any:
    """The ``jax.jit`` of the step for ``layout`` (the last one is kept)."""
    if self._jit[0] is not layout:
      self._jit = (layout, jit_step(layout, self._engine.loss,
                                    self._engine.units_seen))
    return self._jit[1]

  @property
  def jitted(self) -> Any:
    """The raw ``jax.jit`` step (with update_on="host", the device's
    program); see the class docstring for what it returns."""
    return self.jit_for(self._layout())

  def _layout(self):
    layout = self._engine.layout
    if layout is None:
      raise RuntimeError("call engine.init(params) before engine.step: the "
                         "step is built for the layout of those params")
    return layout

  def __call__(self, state: TrainState, batch: Any):
    self.check()
    engine = self._engine
    layout = self._chosen(state, batch)
    jitted = self.jit_for(layout)
    if state is not self._returned:
      # (The state the last step returned is known good: skip the walk.)
      _checks.check_state(state, layout.state_shapes,
                          layout.state_shardings)
    _checks.check_batch(batch)
    batch = engine.shard_batch(batch)
    outputs = jitted(layout.update.device_input(state), batch)
    state, metrics, self._at_min, self._carry = layout.update.after(
        layout, state, outputs, self._carry)
    if not layout.placement.loss_scaling and layout.config.skip_nonfinite:
      self._skipped.append(metrics["skipped"])
    self._returned = state
    # The launcher's watchdog (--watchdog) sees progress. (The skip flag
    # read at the next call waits for this step, so a hung step stops it.)
    _heartbeat.step_done()
    return state, metrics

  def _chosen(self, state: TrainState, batch: Any):
    """The layout to run, with the remat policy chosen if it was "auto"."""
    layout = self._layout()
    if layout.remat is RematPolicy.AUTO:
      self._engine.choose_remat(state, batch)
      layout = self._layout()
    return layout

  def check(self) -> None:
    """Raises if the last step overflowed at the minimum loss scale, or
    ended ``max_consecutive_skips`` non-finite steps in a row. (Read one step
    late, so the host never waits for the step it has just dispatched.)"""
    cfg = self._engine.config
    flag, self._at_min = self._at_min, None
    if flag is not None and bool(flag):
      raise FloatingPointError(
          f"float16 gradients overflowed at the minimum loss scale "
          f"{cfg.min_loss_scale} (ZeroConfig.min_loss_scale): training has "
          "diverged. Lower the learning rate, clip gradients "
          "(clip_grad_norm), lower min_loss_scale, or train in bfloat16.")
    # (Two steps late with delay_update, whose host update of the last
    # step runs while the device computes this one.)
    lag = 2 if cfg.delay_update else 1
    while len(self._skipped) >= lag:
      self._skips = self._skips + 1 if bool(self._skipped.pop(0)) else 0
      if self._skips >= cfg.max_consecutive_skips:
        raise FloatingPointError(
            f"the last {self._skips} steps had a non-finite gradient norm "
            "(NaN or inf) and were skipped (ZeroConfig.skip_nonfinite; "
            f"max_consecutive_skips={cfg.max_consecutive_skips}): training "
            "has diverged or the data holds NaN/inf. Check the batches, "
            "lower the learning rate or clip gradients (clip_grad_norm), "
            "then resume from the last checkpoint.")

  def lower(self, state: TrainState, batch: Any):
    """The jitted step's ``Lowered`` for this state and batch (arrays or
    ``jax.ShapeDtypeStruct``)."""
    return self.lower_with(self._chosen(state, batch), state, batch)

  def lower_with(self, layout, state: TrainState, batch: Any):
    """The ``Lowered`` of the step for ``layout`` (e.g. a remat candidate)."""
    return self.jit_for(layout).lower(layout.update.device_input(state),
                                      self._engine.shard_batch(batch))
