"""Argument checks shared by the analytic estimators (``zero_jax.memory``,
``zero_jax.comm``): each names the argument, the value and the fix."""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from zero_jax.config import STAGES

PSI_FIX = ("pass the parameter count, e.g. 7.5e9 (zero_jax.memory."
           "param_count(params) counts a tree)")
BYTES_FIX = "pass bytes per element, e.g. 2 for bfloat16 or 4 for float32"


def check_number(name: str, value: Any, *, strict: bool = True,
                 fix: str) -> Any:
  """``value`` if it is a finite real number > 0 (>= 0 unless strict).

  Raises:
    ValueError: it is not (bools, strings, nan and inf included); the
      message names the argument, the value and ``fix``.
  """
  if (isinstance(value, numbers.Real) and not isinstance(value, bool)
      and math.isfinite(value) and (value > 0 if strict else value >= 0)):
    return value
  raise ValueError(f"{name} must be a finite number {'>' if strict else '>='}"
                   f" 0, got {value!r}; {fix}")


def check_count(name: str, value: Any, minimum: int = 1, *,
                fix: str) -> int:
  """``value`` if it is an integer >= minimum (not a bool or a float)."""
  if (isinstance(value, numbers.Integral) and not isinstance(value, bool)
      and value >= minimum):
    return int(value)
  hint = (f"write {int(value)}, an int; " if isinstance(value, float)
          and value.is_integer() else "")
  raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}; "
                   f"{hint}{fix}")


def check_flag(name: str, value: Any) -> bool:
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  raise ValueError(f"{name} must be True or False, got {value!r}; True "
                   f"stands for ZeroConfig({name}='host')")


def check_finite(what: str, values: Mapping[str, float]) -> None:
  """Raises when a result overflowed float64 (finite inputs, huge product)."""
  bad = {k: v for k, v in values.items() if not math.isfinite(v)}
  if bad:
    raise ValueError(f"{what} overflows a float64 ({bad}): the inputs are "
                     "too large to be real; check the parameter count and "
                     "bytes per parameter")


def data_axis(devices: int, replica: int) -> int:
  devices = check_count("devices", devices,
                        fix="pass the number of devices in all, e.g. "
                        "jax.device_count()")
  replica = check_count("replica", replica,
                        fix="pass the replica groups R (1: one group)")
  if devices % replica:
    raise ValueError(
        f"devices={devices} is not divisible by replica={replica}: state is "
        "sharded over devices // replica devices and replicated over replica "
        "groups")
  return devices // replica


def check_stage(stage: int) -> None:
  if not (isinstance(stage, numbers.Integral) and not isinstance(stage, bool)
          and stage in STAGES):
    raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")


def check_replicated(replicated: float, psi: float) -> float:
  """Replicated parameters: a finite count in [0, psi]."""
  check_number("replicated", replicated, strict=False,
               fix="pass the count of parameters that stay replicated "
               "(Engine.param_plan.replicated_elements), 0 for none")
  if replicated > psi:
    raise ValueError(f"replicated={replicated!r} exceeds the parameter "
                     f"count psi={psi!r}; it counts parameters among the psi "
                     "(Engine.param_plan.replicated_elements): pass at most "
                     "psi")
  return replicated


def compute_bytes(compute_dtype: Any) -> int | None:
  """Bytes of a 16-bit (or 8-bit) compute dtype; None for fp32 compute."""
  if compute_dtype is None:
    return None
  try:
    dt = jnp.dtype(compute_dtype)
  except TypeError:
    dt = None
  if dt is None or not jnp.issubdtype(dt, jnp.floating) or dt.itemsize > 4:
    raise ValueError(f"compute_dtype must be a float of at most 4 bytes "
                     f"(e.g. 'bfloat16'), got {compute_dtype!r}")
  # fp32 compute is fp32 training: no separate compute copy.
  return None if dt.itemsize == 4 else dt.itemsize
