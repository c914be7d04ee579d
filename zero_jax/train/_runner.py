"""``engine.step``: the jitted train step and the host-side work around it:
checks of the state and batch it is given, the remat choice, the update
strategy's host side, the overflow and skip flags read one step late, and
what a step that fails at run time leaves behind.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from zero_jax.config import RematPolicy
from zero_jax.layout import Decisions
from zero_jax.train import (_accumulate, _auto_remat, _checks, _global,
                            _hooks, _watch)
from zero_jax.train._grads import Loss
from zero_jax.train._state import TrainState
from zero_jax.train._train_step import jit_step
from zero_jax.train._step_plan import StepPlan


class StepFailedError(jax.errors.JaxRuntimeError):
  """``engine.step``'s compiled program failed at run time (out of memory,
  a host callback that raised, a failed collective).

  The message names the step, says whether the state given to it survives,
  the last checkpoint known to this process, and the fix; the original
  error is its ``__cause__``. A ``jax.errors.JaxRuntimeError``, so that
  code catching JAX's run-time errors catches it too.
  """


@dataclasses.dataclass
class _Dispatched:
  """A step dispatched whose outputs the host has not read yet.

  Attributes:
    number: the step's number (the ``state.step`` it returns), or None.
    given: the ``step`` leaf of the state it was given (identifies it).
    given_lost: that state's buffers were donated (or deleted) by it.
    returned: the ``step`` leaf of the state it returned.
    at_min: the overflow-at-minimum-scale flag, until read.
    skipped: the non-finite skip flag, until read.
    outputs: its scalar outputs, read to learn whether it failed.
  """

  number: int | None
  given: Any
  given_lost: bool
  returned: Any
  at_min: Any
  skipped: Any
  outputs: tuple


@dataclasses.dataclass(frozen=True)
class _Failure:
  """The last step that failed at run time, and the states it took."""

  number: int | None
  summary: str
  lost: tuple  # the ``step`` leaves of the states it took with it

  def took(self, state: Any) -> bool:
    """Whether ``state`` is one of the states this failure took."""
    step = getattr(state, "step", None)
    return any(step is x for x in self.lost)


def _lost(state: TrainState) -> bool:
  """Whether a leaf of ``state`` is gone (donated to a step, or deleted)."""
  return any(isinstance(x, jax.Array) and x.is_deleted()
             for x in jax.tree.leaves(state))


def _summary(error: BaseException) -> str:
  """An error in one line: JAX's run-time errors carry the traceback of a
  callback that raised; its last line is the callback's own error."""
  lines = [l.strip() for l in str(error).splitlines() if l.strip()]
  if not lines:
    return type(error).__name__
  first = lines[0].replace("Traceback (most recent call last):", "")
  first = first.strip()
  return first if len(lines) == 1 else f"{first} {lines[-1]}"


def _name(number: int | None) -> str:
  return "a step" if number is None else f"step {number}"


def _fix(error: BaseException, remat: RematPolicy) -> str:
  """What to do about ``error``, by its kind."""
  text = str(error)
  if (isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in text or
      "out of memory" in text.lower()):
    return (
        "It ran out of memory. Fix: a smaller batch per device "
        "(ZeroConfig.micro_batch_size, with more grad_accum_steps to keep "
        f"the global batch), remat (ZeroConfig.remat is '{remat}': 'full' "
        "keeps least, 'auto' picks what fits), or offload "
        "(offload_optimizer='host'; offload_params='host' at stage 3); "
        "python -m zero_jax.estimate tells what fits.")
  if "callback" in text.lower():
    own = [l.strip() for l in text.splitlines() if l.strip()][-1]
    return (f"A host callback in the step raised ({own}): the callback's "
            "own error is the cause (its traceback is in the error above); "
            "fix the callback.")
  return ("The cause is the error above; where it names a collective, "
          "another process may have failed first: check every process's "
          "log.")


def _recovery() -> str:
  """How to get a state again: the last checkpoint, or a fresh init."""
  hint = _hooks.last_checkpoint()
  if hint is None:
    return ("No checkpoint was saved or restored in this process: start "
            "again with state = engine.init(params), or restore one with "
            "zero_jax.Checkpointer(directory).restore(engine, params).")
  return (f"Get a state again: {hint}; or start afresh "
          "with state = engine.init(params).")


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

  A step that fails at run time (out of memory, a host callback that
  raised, a failed collective) raises ``StepFailedError``, a
  ``jax.errors.JaxRuntimeError`` whose cause is JAX's error: at the call
  that dispatched it, or (JAX runs steps asynchronously) at the next call,
  which reads the step's outputs. It names the step, whether the state
  given to it survives (a donated state does not, nor the state a failed
  step returned), the last checkpoint this process saved or restored, and
  the fix. Passing a state the failure took to ``engine.step`` again says
  so; a state from ``engine.init`` or ``Checkpointer.restore`` starts
  afresh, with nothing of the failed run's carried over.

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

  The engine builds it with what the step reads of it, each at its call:

  Args:
    layout: ``layout()`` is the engine's current ``StepPlan`` (None before
      ``init``).
    loss: the engine's ``Loss``.
    decisions: the engine's ``Decisions``.
    units_seen: the engine's count of the blocks run one at a time, filled
      when the step is traced.
    shard_batch: ``Engine.shard_batch``: places a batch on the mesh.
    on_remat: ``on_remat(layout, reason)`` keeps the layout with the remat
      policy that ``remat="auto"`` chose, and why.
  """

  def __init__(self, layout: Callable[[], Any], loss: Loss,
               decisions: Decisions, *, units_seen: dict[str, int],
               shard_batch: Callable[[Any], Any],
               on_remat: Callable[[Any, str], None]):
    self._current = layout
    self._loss = loss
    self._decisions = decisions
    self._units_seen = units_seen
    self._shard_batch = shard_batch
    self._on_remat = on_remat
    self._jit: tuple[Any, Any] = (None, None)  # (layout, its jax.jit)
    self._pending: list[_Dispatched] = []  # steps whose outputs are unread
    self._skips = 0  # skipped steps in a row, up to the last one read
    self._returned = None  # the state the previous step returned
    self._number = None  # its step count, where known
    self._carry = None  # what the update strategy keeps between steps
    self._failure: _Failure | None = None  # the last step that failed
    # The layout whose micro-batch split the first step checked
    # (``_accumulate.check_split``).
    self._split_checked = None

  def reset(self) -> None:
    """Forgets the run so far: what the update strategy carried between
    steps and the flags not yet read (a new state from ``engine.init``, or
    the engine laid out anew)."""
    self._carry = None
    self._returned = None
    self._number = None
    self._pending.clear()
    self._skips = 0

  def jit_for(self, layout: StepPlan) -> Any:
    """The ``jax.jit`` of the step for ``layout`` (the last one is kept)."""
    if self._jit[0] is not layout:
      self._jit = (layout, jit_step(layout, self._loss, self._units_seen))
    return self._jit[1]

  @property
  def jitted(self) -> Any:
    """The raw ``jax.jit`` step (with update_on="host", the device's
    program); see the class docstring for what it returns."""
    return self.jit_for(self._layout())

  def _layout(self):
    layout = self._current()
    if layout is None:
      raise RuntimeError("call engine.init(params) before engine.step: the "
                         "step is built for the layout of those params")
    return layout

  def __call__(self, state: TrainState, batch: Any):
    self._refuse_lost(state)
    # The state the last step returned (or a copy with its step counter)
    # goes on from it; any other (engine.init, a restore) starts afresh.
    goes_on = (self._returned is not None and
               getattr(state, "step", None) is self._returned.step)
    if goes_on:
      self.check()
    layout = self._chosen(state, batch)
    jitted = self.jit_for(layout)
    if state is not self._returned:
      # (The state the last step returned is known good: skip the walk.)
      _checks.check_state(state, layout.state_shapes,
                          layout.state_shardings, layout.update.live)
    _checks.check_batch(batch)
    if not goes_on:
      # What is pending belongs to the history this state leaves: none of
      # its flags, errors or carried buffers apply to it.
      self.reset()
    number = self._count(state)
    try:
      # (Placing the batch can run out of memory too: the state is intact
      # then, and the error says so. The host's update can run out of
      # host memory with numpy's MemoryError.)
      batch = self._shard_batch(batch)
      self._check_split(layout, state, batch)
      outputs = jitted(layout.update.device_input(state), batch)
      new, metrics, at_min, self._carry = layout.update.after(
          layout, state, outputs, self._carry)
    except (jax.errors.JaxRuntimeError, MemoryError) as e:
      raise self._failed_now(state, number, e) from e
    skipped = None
    if not layout.placement.loss_scaling and layout.decisions.skip_nonfinite:
      skipped = metrics["skipped"]
    d = _Dispatched(
        number=number, given=state.step, given_lost=_lost(state),
        returned=new.step, at_min=at_min, skipped=skipped,
        outputs=tuple(x for x in (metrics["loss"], skipped, at_min)
                      if x is not None))
    self._pending.append(d)
    _watch.watch(d.outputs, self._explain(d))
    self._returned, self._number = new, number
    # The launcher's watchdog (--watchdog) sees progress. (The flags read
    # at the next call wait for this step, so a hung step stops it.)
    _hooks.step_done()
    return new, metrics

  def _check_split(self, layout: StepPlan, state: TrainState,
                   batch: Any) -> None:
    """At the first step of a global loss over micro-batches: raises
    unless the micro-batches' weighed loss is the whole batch's."""
    loss = self._loss
    if (self._split_checked is layout or not _accumulate.needs_check(
        layout.decisions, loss, layout.batch.grad_accum_steps)):
      return
    call = _global.global_loss(layout, loss)
    params = (state.compute_params if layout.placement.compute_copy else
              state.params)
    _accumulate.check_split(_accumulate.Split.of(layout, loss),
                            lambda p, b: call(p, b, None)[0], params, batch)
    self._split_checked = layout

  def _chosen(self, state: TrainState, batch: Any):
    """The layout to run, with the remat policy chosen if it was "auto"."""
    layout = self._layout()
    if layout.remat is RematPolicy.AUTO:
      self.choose_remat(layout, state, batch)
      layout = self._layout()
    return layout

  def choose_remat(self, layout: StepPlan, state: TrainState,
                   batch: Any) -> None:
    """With ``remat="auto"`` in ``layout``: compiles the step with each
    candidate policy and hands the fastest that fits, and why, to
    ``on_remat``."""
    if layout.remat is not RematPolicy.AUTO:
      return
    self._on_remat(*_auto_remat.choose(
        layout, lambda candidate: self.lower_with(candidate, state, batch)))

  # ------------------------------------------------ steps that failed

  def _refuse_lost(self, state: Any) -> None:
    """Raises if ``state`` is one a failed step took with it."""
    failure = self._failure
    if failure is None or not failure.took(state):
      return
    raise ValueError(
        f"this TrainState was lost when {_name(failure.number)} failed at "
        f"run time ({failure.summary}): its arrays were donated to that "
        "step or hold its error, not values, and no step can use them. "
        + _recovery())

  def _count(self, state: TrainState) -> int:
    """The number of the step ``state`` is about to take (its
    ``state.step`` + 1): counted on from the last step, else read once."""
    if self._number is not None:
      return self._number + 1
    try:
      return int(state.step) + 1
    except jax.errors.JaxRuntimeError as e:
      raise ValueError(
          f"the TrainState given holds the error of a computation that "
          f"failed ({_summary(e)}), not values: it was returned by a step "
          "that failed, or made from such a state. " + _recovery()) from e

  def _failed_now(self, state: TrainState, number: int | None,
                  error: BaseException) -> StepFailedError:
    """The error for a step that raised as it was dispatched (or a step
    before it, whose failure surfaced only now)."""
    earlier = self._first_failed()
    if earlier is not None:
      return self._failed(earlier, error, also=(state.step,))
    given_lost = _lost(state)
    if given_lost:
      self._failure = _Failure(number, _summary(error), (state.step,))
      self.reset()  # (nothing of the failed run carries over)
      fate = ("The state given to it was donated to it and is gone: do "
              "not pass it to engine.step again. " + _recovery())
    else:
      fate = ("The state given to it was not donated and is unchanged: "
              "engine.step may take it again once the cause is fixed.")
    return StepFailedError(
        f"engine.step: {_name(number)} failed at run time "
        f"({_summary(error)}). {_fix(error, self._remat())} {fate}")

  def _explain(self, d: _Dispatched) -> Any:
    """What the watcher prints the moment step ``d`` fails at run time."""
    remat = self._remat()
    given = ("was donated to it and is gone" if d.given_lost else
             "was not donated and is unchanged")
    return lambda error: (
        f"zero_jax: engine.step: {_name(d.number)} failed at run time "
        f"({_summary(error)}). {_fix(error, remat)} The state given to it "
        f"{given}; the state it returned holds this error instead of "
        "values (reading its metrics raises it), and the next engine.step "
        f"raises StepFailedError. {_recovery()}")

  def _failed_late(self, error: BaseException) -> StepFailedError:
    """The error for a failure seen in a flag read one step late."""
    first = self._first_failed()
    return self._failed(0 if first is None else first, error)

  def _first_failed(self) -> int | None:
    """The index in ``_pending`` of the first step whose outputs hold an
    error (the steps after it inherit it), or None."""
    for i, d in enumerate(self._pending):
      try:
        jax.block_until_ready(d.outputs)
      except jax.errors.JaxRuntimeError:
        return i
    return None

  def _failed(self, index: int, error: BaseException,
              also: tuple = ()) -> StepFailedError:
    """Records that ``_pending[index]`` failed at run time, taking the
    states it and the steps after it returned (and the one given to it,
    if donated), and returns the error to raise."""
    failed, after = self._pending[index], self._pending[index:]
    lost = tuple(d.returned for d in after) + also
    if failed.given_lost:
      lost += (failed.given,)
    self._failure = _Failure(failed.number, _summary(error), lost)
    self.reset()  # (nothing of the failed run carries over)
    given = ("was donated to it and is gone" if failed.given_lost else
             "was not donated and is unchanged (engine.step may take it "
             "again)")
    return StepFailedError(
        f"engine.step: {_name(failed.number)} failed at run time "
        f"({_summary(error)}); JAX runs steps asynchronously, so it shows "
        f"only now. {_fix(error, self._remat())} The state given to it "
        f"{given}; the state it returned (and that of any step after it) "
        "holds this error instead of values: do not pass it to "
        "engine.step again. " + _recovery())

  def _remat(self) -> RematPolicy:
    """The remat policy the step is traced with (``AUTO`` until chosen)."""
    layout = self._current()
    return self._decisions.remat if layout is None else layout.remat

  def _read(self, flag: Any) -> bool:
    """A flag's value; a step that failed shows here, as its error."""
    try:
      return bool(flag)
    except jax.errors.JaxRuntimeError as e:
      raise self._failed_late(e) from e

  # -------------------------------------------------------------- flags

  def check(self) -> None:
    """Raises if the last step overflowed at the minimum loss scale, or
    ended ``max_consecutive_skips`` non-finite steps in a row, or if a
    step failed at run time (``StepFailedError``). (Read one step late, so
    the host never waits for the step it has just dispatched.)"""
    decided = self._decisions
    last = self._pending[-1] if self._pending else None
    if last is not None and last.at_min is not None:
      flag, last.at_min = last.at_min, None
      if self._read(flag):
        raise FloatingPointError(
            f"float16 gradients overflowed at the minimum loss scale "
            f"{decided.loss_scaling.min_scale} (ZeroConfig.min_loss_scale): "
            "training has diverged. Lower the learning rate, clip gradients "
            "(clip_grad_norm), lower min_loss_scale, or train in "
            "bfloat16.")
    # (Two steps late with delay_update, whose host update of the last
    # step runs while the device computes this one.)
    lag = 2 if decided.delay_update else 1
    while len(self._pending) >= lag:
      d = self._pending[0]
      if d.skipped is None:
        # (No skip flag: one output, read, tells whether the step failed.)
        self._read(d.outputs[-1])
        self._pending.pop(0)
        continue
      skipped = self._read(d.skipped)
      self._pending.pop(0)
      self._skips = self._skips + 1 if skipped else 0
      if self._skips >= decided.max_consecutive_skips:
        raise FloatingPointError(
            f"the last {self._skips} steps had a non-finite gradient norm "
            "(NaN or inf) and were skipped (ZeroConfig.skip_nonfinite; "
            f"max_consecutive_skips={decided.max_consecutive_skips}): training "
            "has diverged or the data holds NaN/inf. Check the batches, "
            "lower the learning rate or clip gradients (clip_grad_norm), "
            "then resume from the last checkpoint.")

  def lower(self, state: TrainState, batch: Any):
    """The jitted step's ``Lowered`` for this state and batch (arrays or
    ``jax.ShapeDtypeStruct``)."""
    return self.lower_with(self._chosen(state, batch), state, batch)

  def lower_with(self, layout: StepPlan, state: TrainState, batch: Any):
    """The ``Lowered`` of the step for ``layout`` (e.g. a remat candidate)."""
    return self.jit_for(layout).lower(layout.update.device_input(state),
                                      self._shard_batch(batch))
