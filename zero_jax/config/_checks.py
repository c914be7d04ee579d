"""Field checks for ``ZeroConfig``: each returns the value in its canonical
type or raises a ValueError that names the field, the value and the fix."""

from __future__ import annotations

import math
import numbers
from typing import Any, NoReturn

import numpy as np


def got(value: Any) -> str:
  """``value`` for an error message, with its type where repr hides it."""
  text = repr(value)
  if len(text) > 60:
    text = text[:50] + "..."
  if value is None or type(value) in (int, float, bool):
    return text
  return f"{text} (a {type(value).__name__})"


def fail(name: str, what: str, value: Any, fix: str) -> NoReturn:
  """Raises the ValueError every field check uses: field, value, fix."""
  # A number written as a string, or an int written as a float, is the
  # usual slip (configs read from YAML or the command line): say so.
  if isinstance(value, str):
    try:
      float(value)
      fix = f"write the number without quotes; {fix}"
    except ValueError:
      pass
  elif isinstance(value, bool):
    fix = f"True/False is not a number here; {fix}"
  raise ValueError(f"ZeroConfig.{name} must be {what}, got {got(value)}; "
                   f"{fix}")


def is_int(value: Any) -> bool:
  # numbers.Integral admits numpy integers; bool is an int to Python but
  # stage=True is a mistake, not stage 1.
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(name: str, value: Any, minimum: int,
               maximum: int | None = None, *, optional: bool = False,
               fix: str) -> int | None:
  """``value`` as a Python int in [minimum, maximum] (or None if optional).

  Raises:
    ValueError: not an int (bools, floats and strings included) or out of
      range; the message names the field, the value and ``fix``.
  """
  if optional and value is None:
    return None
  if (is_int(value) and value >= minimum
      and (maximum is None or value <= maximum)):
    return int(value)
  what = (f"an integer >= {minimum}" if maximum is None else
          f"an integer in [{minimum}, {maximum}]")
  if isinstance(value, float) and value.is_integer():
    fix = f"write {int(value)}, an int, not {value!r}; {fix}"
  fail(name, ("None or " if optional else "") + what, value, fix)


def check_float(name: str, value: Any, minimum: float, *,
                 strict: bool = False, maximum: float | None = None,
                 optional: bool = False, what: str | None = None,
                 fix: str) -> float | None:
  """``value`` as a finite Python float > (or >=) minimum, <= maximum.

  Ints are floats here (``clip_grad_norm=1``); nan and inf never are.

  Raises:
    ValueError: not a real number, not finite or out of range; the message
      names the field, the value and ``fix``.
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
  fail(name, what, value, fix)


def check_bool(name: str, value: Any, fix: str) -> bool:
  """``value`` as a Python bool; 0/1, strings and None are mistakes."""
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  fail(name, "True or False", value, fix)


def check_choice(name: str, value: Any, choices: tuple[Any, ...],
                  fix: str) -> Any:
  """``value`` if it is one of ``choices`` (compared by type and value)."""
  # By type first: an array (or other odd) value must not reach an ``==``
  # whose truth is ambiguous, nor an ``in`` test that needs a hash.
  if any(isinstance(value, type(c)) and value == c for c in choices):
    return value
  fail(name, f"one of {choices}", value, fix)
