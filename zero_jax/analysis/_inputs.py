"""Argument checks of the analytic estimators (``estimate_memory``,
``estimate_comm`` and the paper's formula, in ``zero_jax.analysis``), built
on the package's shared checks: each names the argument, the value and the
fix."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from zero_jax._checks import check_choice, check_float, check_int, fail
from zero_jax.config._config import STAGES

PSI_FIX = ("pass the parameter count, e.g. 7.5e9 (zero_jax.analysis."
           "param_count(params) counts a tree)")
BYTES_FIX = "pass bytes per element, e.g. 2 for bfloat16 or 4 for float32"


def data_axis(devices: int, replica: int) -> int:
  """Devices of the ``data`` axis: ``devices`` split into ``replica``
  groups."""
  devices = check_int("devices", devices, 1,
                      fix="pass the number of devices in all, e.g. "
                      "jax.device_count()")
  replica = check_int("replica", replica, 1,
                      fix="pass the replica groups R (1: one group)")
  if devices % replica:
    raise ValueError(
        f"devices={devices} is not divisible by replica={replica}: state is "
        "sharded over devices // replica devices and replicated over replica "
        "groups")
  return devices // replica


def check_stage(stage: Any) -> int:
  """``stage`` as a Python int, if it is one of ``STAGES``."""
  *first, last = STAGES
  return check_choice("stage", stage, STAGES,
                      what=f"{', '.join(map(str, first))} or {last}",
                      fix="pass the ZeRO stage as an int")


def check_replicated(replicated: float, psi: float) -> float:
  """Replicated parameters: a finite count in [0, psi]."""
  check_float("replicated", replicated,
              fix="pass the count of parameters that stay replicated "
              "(Engine.param_plan.replicated_elements), 0 for none")
  if replicated > psi:
    raise ValueError(f"replicated={replicated!r} exceeds the parameter "
                     f"count psi={psi!r}; it counts parameters among the psi "
                     "(Engine.param_plan.replicated_elements): pass at most "
                     "psi")
  return replicated


def compute_bytes(dtype: Any, name: str = "compute_dtype") -> int | None:
  """Bytes of a 16-bit (or 8-bit) dtype ``name``; None for fp32."""
  if dtype is None:
    return None
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    dt = None
  if dt is None or not jnp.issubdtype(dt, jnp.floating) or dt.itemsize > 4:
    fail(name, "a float dtype of at most 4 bytes", dtype,
         "pass e.g. 'bfloat16', or None for float32")
  # fp32 compute is fp32 training: no separate compute copy.
  return None if dt.itemsize == 4 else dt.itemsize
