"""``ZeroConfig(remat="auto")``: the fastest rematerialization policy whose
compiled step fits the device's memory.

Keeping more of forward's activations for backward is faster (less to
recompute) and costs memory; how much is a compile-time fact. When the step
is first lowered or run, the engine compiles it with each policy of
``AUTO_CANDIDATES``, fastest first, and keeps the first whose compiled peak
(``memory_analysis()``) fits the device: ``ZeroConfig.device_memory_bytes``,
else what the device reports (a GPU's allocator limit, a compile-only GPU's
spec from ``zero_jax.aot``, a CPU device's share of the host's memory). None
fitting, it keeps the leanest and says so. ``Engine.describe()`` gives the
choice and the peaks behind it.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import jax

from zero_jax import aot, measure
from zero_jax.remat import AUTO_CANDIDATES


def device_memory(device: jax.Device) -> int | None:
  """Bytes the step may use on ``device``, or None if unknown."""
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except
    stats = None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  known = aot.device_memory(device)
  if known is not None:
    return known
  if device.platform == "cpu":
    try:
      total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
      return None
    return total // max(1, len(jax.local_devices(backend="cpu")))
  return None


def choose(engine: Any, state: Any, batch: Any,
           build: Callable[[Any], Any]) -> None:
  """Sets ``engine.remat`` to the policy to trace the step with, and
  ``engine.remat_reason`` to why, compiling the step (``build(engine)``:
  its ``jax.jit``) for each candidate."""
  budget = (engine.config.device_memory_bytes or
            device_memory(engine.mesh.devices.flat[0]))
  tried = []
  for name in AUTO_CANDIDATES:
    engine.remat = name
    engine._jitted = build(engine)  # pylint: disable=protected-access
    with jax.set_mesh(engine.mesh):
      compiled = engine.step.lower(state, batch).compile()
    peak = measure.compiled_memory(compiled).peak
    tried.append(f"{name} {peak / 2**30:.2f} GiB")
    if budget is None or peak <= budget:
      break
  fits = budget is None or peak <= budget
  limit = ("no known memory limit" if budget is None else
           f"{'fits' if fits else 'none fits'} {budget / 2**30:.2f} GiB")
  engine.remat_reason = (f"remat auto chose {engine.remat} ({limit}; "
                         f"compiled peaks: {', '.join(tried)})")
