"""Value checks shared by every subpackage: ``ZeroConfig``'s fields, the
estimators' arguments and the DeepSpeed reader's keys.

Each check returns the value in its canonical Python type or raises a
ValueError that reads ``"<name> must be <what>, got <value>; <fix>"``. The
caller names the checked thing in full, so one check serves a field
(``"ZeroConfig.stage"``), an argument (``"psi"``) and a JSON key
(``"DeepSpeed config key 'fp16.hysteresis'"``) alike.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, NoReturn

import numpy as np


def got(value: Any) -> str:
  """``value`` for an error message, with its type where repr hides it."""
  text = repr(value)
  if len(text) > 60:
    text = text[:50] + "..."
  if value is None or type(value) in (int, float, bool):
    return text
  return f"{text} (a {type(value).__name__})"


def fail(name: str, what: str, value: Any, fix: str | None = None
         ) -> NoReturn:
  """Raises the ValueError every check uses: name, what, value, fix.

  Args:
    name: the checked thing, in full (``"ZeroConfig.seed"``, ``"psi"``).
    what: what it must be (``"an integer >= 0"``).
    value: what it is.
    fix: what to write instead; None leaves the message at the value.

  Raises:
    ValueError: always.
  """
  raise ValueError(f"{name} must be {what}, got {got(value)}"
                   + (f"; {fix}" if fix else ""))


def _join(*parts: str | None) -> str | None:
  """The parts of a fix that are given, in order ("; " between them)."""
  return "; ".join(p for p in parts if p) or None


def _number_fix(value: Any, fix: str | None) -> str | None:
  """``fix``, after a hint where a number was expected and ``value`` is the
  usual slip: a number in quotes (configs read from YAML, JSON or the
  command line), or a bool."""
  if isinstance(value, str):
    try:
      float(value)
    except ValueError:
      return fix
    return _join("write the number without quotes", fix)
  if isinstance(value, (bool, np.bool_)):
    return _join("True/False is not a number here", fix)
  return fix


def is_int(value: Any) -> bool:
  """Whether ``value`` is an integer (numpy's too), not a bool."""
  # numbers.Integral admits numpy integers; bool is an int to Python but
  # stage=True is a mistake, not stage 1.
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
  """Whether ``value`` is a real number (numpy's too), not a bool."""
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(name: str, value: Any, minimum: int,
              maximum: int | None = None, *, optional: bool = False,
              fix: str | None = None) -> int | None:
  """``value`` as a Python int in [minimum, maximum] (or None if optional).

  Args:
    name: the checked thing, in full, for the message.
    value: the value to check.
    minimum: the smallest value allowed.
    maximum: the largest value allowed (None: no bound).
    optional: whether None is allowed (and returned).
    fix: what to write instead, for the message.

  Returns:
    The int (numpy integers become Python ones), or None.

  Raises:
    ValueError: not an int (bools, floats and strings included) or out of
      range; the message names ``name``, the value and ``fix``.
  """
  if optional and value is None:
    return None
  if (is_int(value) and value >= minimum
      and (maximum is None or value <= maximum)):
    return int(value)
  what = (f"an integer >= {minimum}" if maximum is None else
          f"an integer in [{minimum}, {maximum}]")
  if isinstance(value, float) and value.is_integer():
    fix = _join(f"write {int(value)}, an int, not {value!r}", fix)
  fail(name, ("None or " if optional else "") + what, value,
       _number_fix(value, fix))


def check_float(name: str, value: Any, minimum: float = 0.0, *,
                strict: bool = False, maximum: float | None = None,
                optional: bool = False, what: str | None = None,
                fix: str | None = None) -> float | None:
  """``value`` as a finite Python float > (or >=) minimum, <= maximum.

  Ints are floats here (``clip_grad_norm=1``); nan and inf never are.

  Args:
    name: the checked thing, in full, for the message.
    value: the value to check.
    minimum: the lower bound.
    strict: whether the bound is excluded (> rather than >=).
    maximum: the largest value allowed (None: no bound).
    optional: whether None is allowed (and returned).
    what: what the message says it must be (None: said from the bounds).
    fix: what to write instead, for the message.

  Returns:
    The float, or None.

  Raises:
    ValueError: not a real number, not finite or out of range; the message
      names ``name``, the value and ``fix``.
  """
  if optional and value is None:
    return None
  if (is_real(value) and math.isfinite(value)
      and (value > minimum if strict else value >= minimum)
      and (maximum is None or value <= maximum)):
    return float(value)
  if what is None:
    what = f"a finite number {'>' if strict else '>='} {minimum:g}"
    if maximum is not None:
      what += f" and <= {maximum:g}"
    if optional:
      what = "None or " + what
  fail(name, what, value, _number_fix(value, fix))


def check_bool(name: str, value: Any, fix: str | None = None, *,
               what: str = "True or False") -> bool:
  """``value`` as a Python bool; 0/1, strings and None are mistakes.

  Args:
    name: the checked thing, in full, for the message.
    value: the value to check.
    fix: what to write instead, for the message.
    what: how the message spells a bool (JSON's is ``"true or false"``).

  Returns:
    The bool (numpy's becomes Python's).

  Raises:
    ValueError: not a bool.
  """
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  fail(name, what, value, fix)


def check_str(name: str, value: Any, fix: str | None = None) -> str:
  """``value`` if it is a string.

  Raises:
    ValueError: it is not; the message names ``name``, the value and
      ``fix``.
  """
  if isinstance(value, str):
    return value
  fail(name, "a string", value, fix)


def _same_kind(value: Any, choice: Any) -> bool:
  # An int choice takes numpy integers, never a bool (True is not 1 here).
  if is_int(choice):
    return is_int(value)
  return isinstance(value, type(choice))


def check_choice(name: str, value: Any, choices: tuple[Any, ...],
                 fix: str | None = None, *, what: str | None = None) -> Any:
  """The one of ``choices`` that ``value`` is (compared by kind and value).

  Args:
    name: the checked thing, in full, for the message.
    value: the value to check.
    choices: the values allowed.
    fix: what to write instead, for the message.
    what: what the message says it must be (None: ``one of <choices>``).

  Returns:
    The matching choice (so ``np.int64(2)`` comes back as ``2``).

  Raises:
    ValueError: ``value`` is none of them.
  """
  # By kind first: an array (or other odd) value must not reach an ``==``
  # whose truth is ambiguous, nor an ``in`` test that needs a hash.
  for choice in choices:
    if _same_kind(value, choice) and value == choice:
      return choice
  if choices and all(is_real(c) for c in choices):
    fix = _number_fix(value, fix)
  fail(name, what or f"one of {choices}", value, fix)


def check_finite(what: str, values: Mapping[str, float], fix: str) -> None:
  """Raises when a result overflowed float64 (finite inputs, huge product).

  Args:
    what: the computation, for the message (``"estimate_comm(psi=1e308)"``).
    values: its results by name.
    fix: what to check instead, for the message.

  Raises:
    ValueError: a value is nan or infinite; the message lists them.
  """
  bad = {k: v for k, v in values.items() if not math.isfinite(v)}
  if bad:
    raise ValueError(f"{what} overflows a float64 ({bad}): {fix}")
