"""DeepSpeed's learning-rate schedules (``deepspeed/runtime/lr_schedules.py``)
as optax schedules, and the reader of a config section's ``params``.

DeepSpeed's scheduler sets the rate of the first update in its constructor
(``last_batch_iteration = -1``) and the engine calls ``step()`` after every
applied optimizer step, so update ``k`` (k = 0, 1, ...) uses ``get_lr()``
at ``last_batch_iteration = k - 1``. optax counts the updates applied so
far, so ``schedule(k)`` here is that rate. Formulas follow DeepSpeed's
master branch at commit edaa722 (after v0.19.5), where ``WarmupLR``'s
``warmup_max_lr`` defaults to the optimizer's ``lr`` and OneCycle's stair
counts take effect.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax

from zero_jax._checks import check_bool, check_float, check_int, fail
from zero_jax.config._ds_keys import is_auto, key_name
from zero_jax.config._ds_transforms import as_real

# DeepSpeed's ``lr_schedules`` classes, spelled as DeepSpeed spells them.
SCHEDULERS: tuple[str, ...] = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
                               "OneCycle", "LRRangeTest")
_TORCH_SCHEDULERS = (
    "LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR",
    "LinearLR", "ExponentialLR", "SequentialLR", "CosineAnnealingLR",
    "ChainedScheduler", "ReduceLROnPlateau", "CyclicLR",
    "CosineAnnealingWarmRestarts", "OneCycleLR", "PolynomialLR")


def auto_error(path: str) -> ValueError:
  """The error for a key still \"auto\" here, naming it and the fix."""
  return ValueError(
      f"{key_name(path)} is \"auto\": \"auto\" is resolved before the "
      "optimizer is built, from what zj.initialize is told (pass the value "
      "as HF's Trainer would fill it) or write a number in the config")


def no_auto(path: str, value: Any) -> Any:
  """``value``, unless it (or an item of it) is ``"auto"``.

  Raises:
    ValueError: naming the dotted key of the ``"auto"``.
  """
  if is_auto(value):  # (as the reader spells it: any case, spaces)
    raise auto_error(path)
  if isinstance(value, (list, tuple)):
    for i, item in enumerate(value):
      no_auto(f"{path}[{i}]", item)
  return value


class Params:
  """One section's ``params``: unknown names refused, every read checked
  for ``"auto"`` and named by its dotted key."""

  def __init__(self, params: Any, prefix: str, accepted: tuple[str, ...],
               owner: str, fix: str):
    no_auto(prefix, params)
    if params is None:
      params = {}
    if not isinstance(params, Mapping):
      fail(key_name(prefix), "a JSON object of parameters", params,
           "write {\"name\": value, ...}")
    for name in params:
      if name not in accepted:
        raise ValueError(
            f"{key_name(f'{prefix}.{name}')} is not a parameter of {owner} "
            f"that zero_jax knows; accepted: {', '.join(accepted)}; {fix}")
    self.params, self.prefix = params, prefix

  def path(self, name: str) -> str:
    return f"{self.prefix}.{name}"

  def has(self, name: str) -> bool:
    return name in self.params

  def raw(self, name: str, default: Any) -> Any:
    return no_auto(self.path(name), self.params.get(name, default))

  def number(self, name: str, default: float | None, minimum: float = 0.0,
             *, strict: bool = False, required: str | None = None) -> float:
    if required is not None and name not in self.params:
      raise ValueError(f"{key_name(self.path(name))} is missing: {required}")
    return check_float(key_name(self.path(name)), self.raw(name, default),
                       minimum, strict=strict)

  def integer(self, name: str, default: int | None, minimum: int, *,
              required: str | None = None) -> int:
    if required is not None and name not in self.params:
      raise ValueError(f"{key_name(self.path(name))} is missing: {required}")
    return check_int(key_name(self.path(name)), self.raw(name, default),
                     minimum)

  def flag(self, name: str, default: bool) -> bool:
    return check_bool(key_name(self.path(name)), self.raw(name, default),
                      what="true or false")

  def beta(self, name: str, value: Any) -> float:
    path = key_name(self.path(name))
    what = "a number in [0, 1)"
    beta = check_float(path, value, 0.0, what=what)
    if beta >= 1:
      fail(path, what, value, "a beta of 1 never forgets (and divides by "
           "zero in the bias correction)")
    return beta

  def betas(self, default: tuple[float, float]) -> tuple[float, float]:
    value = self.raw("betas", default)
    path = self.path("betas")
    if not (isinstance(value, (list, tuple)) and len(value) == 2):
      fail(key_name(path), "a list of two numbers [beta1, beta2]", value,
           "write e.g. [0.9, 0.999]")
    return (self.beta("betas[0]", value[0]), self.beta("betas[1]", value[1]))


def read_section(section: Any, name: str, extra: tuple[str, ...] = ()
                 ) -> tuple[str, Any]:
  """The ``type`` and ``params`` of the ``optimizer`` or ``scheduler``
  section; other keys (but ``extra``) are refused."""
  if not isinstance(section, Mapping):
    fail(key_name(name), "a JSON object {\"type\": ..., \"params\": {...}}",
         section)
  for key in section:
    if key not in ("type", "params") + extra:
      raise ValueError(
          f"{key_name(f'{name}.{key}')} is not a key of DeepSpeed's {name} "
          f"section; accepted: {', '.join(('type', 'params') + extra)}")
  if "type" not in section:
    raise ValueError(f"{key_name(f'{name}.type')} is missing: name the "
                     f"{name}, e.g. " + ("\"AdamW\"" if name == "optimizer"
                                         else "\"WarmupLR\""))
  kind = no_auto(f"{name}.type", section["type"])
  if not isinstance(kind, str):
    fail(key_name(f"{name}.type"), "a string", kind)
  return kind, section.get("params")


# ---------------------------------------------------------------------------
# Schedules. ``k`` is the number of updates applied before this one;
# ``i = k - 1`` is DeepSpeed's ``last_batch_iteration`` when that update
# runs.


class Schedule(NamedTuple):
  """A scheduler section read: the rate per update, and OneCycle's beta1
  per update where it cycles momentum."""
  lr: optax.Schedule
  # OneCycle's beta1 per update (beta2 is then 0.99); None: betas as given.
  beta1: optax.Schedule | None = None


def _iteration(count: jax.Array) -> jax.Array:
  return as_real(count) - 1


def _warmup_gamma(i: jax.Array, num_steps: int, kind: str) -> jax.Array:
  """``WarmupLR._get_gamma`` inside the warmup (``i < num_steps``)."""
  if kind == "log":
    # inverse_log_warm_up * log(i + 1); i = -1 is handled by the caller.
    return jnp.log(jnp.maximum(i + 1, 1)) / math.log(num_steps)
  return i / num_steps


def _warmup_params(p: Params, what: str) -> tuple[int, str]:
  steps = p.integer("warmup_num_steps", 1000, 1)
  kind = p.raw("warmup_type", "log")
  if kind not in ("log", "linear"):
    fail(key_name(p.path("warmup_type")), "\"log\" or \"linear\"", kind,
         f"DeepSpeed's {what} has only these two warmup curves")
  # DeepSpeed: self.warmup_num_steps = max(2, warmup_num_steps).
  return max(2, steps), kind


def _last_batch_iteration(p: Params) -> None:
  value = p.raw("last_batch_iteration", -1)
  if not (isinstance(value, int) and not isinstance(value, bool)
          and value == -1):
    fail(key_name(p.path("last_batch_iteration")), "-1 (a fresh schedule)",
         value, "zero_jax resumes a schedule from the optimizer state's "
         "step count in its checkpoint; remove the key")


_WARMUP = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
           "warmup_type", "last_batch_iteration")
_COSINE = ("total_num_steps", "warmup_min_ratio", "warmup_num_steps",
           "cos_min_ratio", "warmup_type", "last_batch_iteration")
_ONE_CYCLE = ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate",
              "cycle_first_step_size", "cycle_second_step_size",
              "cycle_first_stair_count", "cycle_second_stair_count",
              "decay_step_size", "cycle_momentum", "cycle_min_mom",
              "cycle_max_mom", "decay_mom_rate", "last_batch_iteration")
_RANGE_TEST = ("lr_range_test_min_lr", "lr_range_test_step_size",
               "lr_range_test_step_rate", "lr_range_test_staircase",
               "last_batch_iteration")
_SCHEDULE_PARAMS = {"WarmupLR": _WARMUP,
                    "WarmupDecayLR": _WARMUP + ("total_num_steps",),
                    "WarmupCosineLR": _COSINE, "OneCycle": _ONE_CYCLE,
                    "LRRangeTest": _RANGE_TEST}


def _warmup_lr(p: Params, base_lr: float, decay: bool) -> optax.Schedule:
  """``WarmupLR`` / ``WarmupDecayLR``: ``min + (max - min) * gamma(i)``,
  and ``min`` for the first update (``get_lr`` at ``i = -1``)."""
  total = (p.integer("total_num_steps", None, 1,
                     required="WarmupDecayLR decays to 0 at this step")
           if decay else None)
  lo = p.number("warmup_min_lr", 0.0)
  # WarmupLR's warmup_max_lr defaults to the optimizer's lr; WarmupDecayLR
  # passes its own default, 0.001.
  hi = p.number("warmup_max_lr", 0.001 if decay else base_lr)
  steps, kind = _warmup_params(p, "WarmupDecayLR" if decay else "WarmupLR")
  _last_batch_iteration(p)

  def schedule(count):
    i = _iteration(count)
    after = 1.0
    if decay:
      after = jnp.maximum(0.0, (total - i) / max(1.0, total - steps))
    gamma = jnp.where(i < steps, _warmup_gamma(i, steps, kind), after)
    gamma = jnp.where(i < 0, 0.0, gamma)
    return lo + (hi - lo) * gamma

  return schedule


def _warmup_cosine_lr(p: Params, base_lr: float) -> optax.Schedule:
  """``WarmupCosineLR``: ``base_lr * ratio(i)``, and 0 for the first update
  (``get_lr`` returns 0.0 at ``i = -1``)."""
  total = p.integer("total_num_steps", None, 1,
                    required="WarmupCosineLR's cosine ends at this step")
  min_ratio = p.number("warmup_min_ratio", 0.0)
  cos_min = p.number("cos_min_ratio", 0.0001)
  steps, kind = _warmup_params(p, "WarmupCosineLR")
  _last_batch_iteration(p)

  def schedule(count):
    i = _iteration(count)
    warm = min_ratio + _warmup_gamma(i, steps, kind) * (1.0 - min_ratio)
    progress = jnp.minimum(1.0, (i - steps + 1) / max(1, total - steps))
    cos = (1 + jnp.cos(jnp.pi * progress)) / 2
    after = jnp.maximum(0.0, cos_min + (1.0 - cos_min) * cos)
    ratio = jnp.where(i < steps, warm, after)
    return jnp.where(i < 0, 0.0, base_lr * ratio)

  return schedule


def _lr_range_test(p: Params) -> optax.Schedule:
  """``LRRangeTest``: ``min_lr * (1 + rate * interval)`` with interval
  ``(i + 1) / step_size``, floored with ``staircase``."""
  lo = p.number("lr_range_test_min_lr", 1e-3)
  size = p.integer("lr_range_test_step_size", 2000, 1)
  rate = p.number("lr_range_test_step_rate", 1.0)
  stairs = p.flag("lr_range_test_staircase", False)
  _last_batch_iteration(p)

  def schedule(count):
    interval = (_iteration(count) + 1) / size
    if stairs:
      interval = jnp.floor(interval)
    return lo * (1 + rate * interval)

  return schedule


def _one_cycle(p: Params) -> Schedule:
  """``OneCycle``: the lr (and, with ``cycle_momentum``, beta1) of
  ``_get_cycle_lr`` / ``_get_decay_lr`` (``_get_cycle_mom`` /
  ``_get_decay_mom``). The first update uses ``cycle_min_lr`` and
  ``cycle_min_mom`` (set by the constructor), and ``betas[1]`` is 0.99
  whenever momentum cycles."""
  need = "DeepSpeed's OneCycle has no default for it"
  lo = p.number("cycle_min_lr", None, required=need)
  hi = p.number("cycle_max_lr", None, required=need)
  decay_lr = p.number("decay_lr_rate", 0.0)
  first = p.number("cycle_first_step_size", 2000, strict=True)
  second = (p.number("cycle_second_step_size", None)
            if p.raw("cycle_second_step_size", None) is not None else first)
  first_stairs = p.integer("cycle_first_stair_count", 0, 0)
  second_stairs = (p.integer("cycle_second_stair_count", None, 0)
                   if p.raw("cycle_second_stair_count", None) is not None
                   else first_stairs)
  decay_size = p.number("decay_step_size", 0)
  cycle_momentum = p.flag("cycle_momentum", True)
  lo_mom = p.beta("cycle_min_mom", p.raw("cycle_min_mom", 0.8))
  hi_mom = p.beta("cycle_max_mom", p.raw("cycle_max_mom", 0.9))
  decay_mom = p.number("decay_mom_rate", 0.0)
  _last_batch_iteration(p)
  total = first + second
  ratio = first / total
  skip_lr_decay = math.isclose(decay_size, 0) or math.isclose(decay_lr, 0)
  skip_mom_decay = math.isclose(decay_size, 0) or math.isclose(decay_mom, 0)

  def stairs(b, count):  # the stair branch, count > 0 stairs
    at = jnp.mod(b, total)  # cycle_iteration
    down = (total - at) * count / (second or 1.0)
    return jnp.floor(jnp.where(at <= first, at * count / first, down)
                     ) / count

  def scale_factor(b):  # _get_scale_factor at batch_iteration b = i + 1
    cycle = jnp.floor(1 + b / total)
    x = 1.0 + b / total - cycle
    # The half is chosen by x, each half with its own stair count.
    up = stairs(b, first_stairs) if first_stairs > 0 else x / ratio
    down = (stairs(b, second_stairs) if second_stairs > 0 else
            (x - 1) / ((ratio - 1) if ratio != 1 else 1.0))
    return jnp.where(x <= ratio, up, down)

  def lr(count):
    i = _iteration(count)
    cycle_lr = lo + (hi - lo) * scale_factor(i + 1)
    if skip_lr_decay:
      decay_lr_value = lo
    else:
      decay_lr_value = lo / (1 + decay_lr * (i - total + 1) / decay_size)
    return jnp.where(i < total, cycle_lr, decay_lr_value)

  def beta1(count):
    i = _iteration(count)
    cycle_mom = hi_mom - (hi_mom - lo_mom) * scale_factor(i + 1)
    if skip_mom_decay:
      decay_value = hi_mom
    else:
      decay_value = hi_mom * (1 + decay_mom * (i - total + 1) / decay_size)
    mom = jnp.where(i < total, cycle_mom, decay_value)
    return jnp.where(i < 0, lo_mom, mom)

  return Schedule(lr, beta1 if cycle_momentum else None)


def parse_schedule(scheduler: Mapping[str, Any], base_lr: float) -> Schedule:
  """The ``Schedule`` of a scheduler section (see
  ``schedule_from_deepspeed``); ``base_lr`` is the optimizer's ``lr``."""
  kind, params = read_section(scheduler, "scheduler")
  if kind not in SCHEDULERS:
    if kind in _TORCH_SCHEDULERS:
      raise ValueError(
          f"{key_name('scheduler.type')} is {kind!r}, a torch.optim."
          "lr_scheduler class, which zero_jax does not rebuild; write the "
          "schedule with optax (e.g. optax.warmup_cosine_decay_schedule), "
          "pass it as learning_rate of your optax optimizer and pass that "
          f"as tx; DeepSpeed schedules accepted: {', '.join(SCHEDULERS)}")
    lower = {s.lower(): s for s in SCHEDULERS}
    if kind.lower() not in lower:
      fail(key_name("scheduler.type"), f"one of {', '.join(SCHEDULERS)}",
           kind, "DeepSpeed's other schedules are torch's: write them with "
           "optax and pass tx")
    kind = lower[kind.lower()]
  p = Params(params, "scheduler.params", _SCHEDULE_PARAMS[kind],
              f"DeepSpeed's {kind} schedule", "remove it or check the "
              "spelling")
  if kind in ("WarmupLR", "WarmupDecayLR"):
    return Schedule(_warmup_lr(p, base_lr, kind == "WarmupDecayLR"))
  if kind == "WarmupCosineLR":
    return Schedule(_warmup_cosine_lr(p, base_lr))
  if kind == "LRRangeTest":
    return Schedule(_lr_range_test(p))
  return _one_cycle(p)


def schedule_from_deepspeed(scheduler: Mapping[str, Any], base_lr: float
                            ) -> optax.Schedule:
  """The learning rate per update of a DeepSpeed ``scheduler`` section.

  ``schedule(k)`` is the rate DeepSpeed uses for the update after ``k``
  applied updates, as optax counts them: pass it as ``learning_rate`` of an
  optax optimizer. Types (DeepSpeed's ``lr_schedules``, case-insensitive
  here) and their params, with DeepSpeed's defaults:

  * ``WarmupLR``: ``warmup_min_lr`` (0), ``warmup_max_lr`` (``base_lr``),
    ``warmup_num_steps`` (1000), ``warmup_type`` ("log" or "linear").
  * ``WarmupDecayLR``: those, ``warmup_max_lr`` defaulting to 0.001, and
    ``total_num_steps`` (required): linear decay to 0 at it.
  * ``WarmupCosineLR``: ``total_num_steps`` (required), ``warmup_min_ratio``
    (0), ``warmup_num_steps`` (1000), ``cos_min_ratio`` (0.0001),
    ``warmup_type`` ("log"); rates are ratios of ``base_lr``, and the first
    update's rate is 0.
  * ``OneCycle``: ``cycle_min_lr``, ``cycle_max_lr`` (required),
    ``decay_lr_rate`` (0), ``cycle_first_step_size`` (2000),
    ``cycle_second_step_size`` (the first), ``cycle_first_stair_count`` (0),
    ``cycle_second_stair_count`` (the first), ``decay_step_size`` (0), and
    the momentum cycle (``cycle_momentum`` (true), ``cycle_min_mom`` (0.8),
    ``cycle_max_mom`` (0.9), ``decay_mom_rate`` (0)), which only
    ``optimizer_from_deepspeed`` applies.
  * ``LRRangeTest``: ``lr_range_test_min_lr`` (0.001),
    ``lr_range_test_step_size`` (2000), ``lr_range_test_step_rate`` (1),
    ``lr_range_test_staircase`` (false).

  Args:
    scheduler: the ``scheduler`` section, ``{"type": ..., "params": {...}}``.
    base_lr: the optimizer's learning rate (``optimizer.params.lr``), which
      ``WarmupCosineLR`` scales and ``WarmupLR`` warms up to by default.

  Returns:
    The schedule: number of updates applied -> learning rate.

  Raises:
    ValueError: an unknown type or param, a value of the wrong type or
      range, or ``"auto"``; the message names the dotted key.
  """
  base_lr = check_float("base_lr", base_lr, 0.0)
  return parse_schedule(scheduler, base_lr).lr
