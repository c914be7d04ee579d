"""``ZeroConfig(remat="auto")``: the fastest rematerialization policy whose
compiled step fits the device's memory.

Keeping more of forward's activations for backward is faster (less to
recompute) and costs memory; how much is a compile-time fact. When the step
is first lowered or run, the engine compiles it with each policy of
``AUTO_CANDIDATES``, fastest first, and keeps the first whose compiled peak
(``memory_analysis()``) fits the device: ``ZeroConfig.device_memory_bytes``,
else what the device reports (a GPU's allocator limit, a compile-only GPU's
spec, a CPU device's share of the host's memory). None fitting, it keeps
the leanest and says so. ``Engine.describe()`` gives the choice and the
peaks behind it.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from typing import Any, Callable

import jax

from zero_jax._devices import compiled_memory, device_memory
from zero_jax.config import RematPolicy
from zero_jax.config._remat import AUTO_CANDIDATES
from zero_jax.train._step_plan import StepPlan


# Compiled peaks of the candidates compiled in this process, by program:
# an engine built again for the same step (a sweep, a restart in one
# process) finds its candidates here instead of compiling each again.
_PEAKS: collections.OrderedDict[tuple, int] = collections.OrderedDict()
_PEAKS_KEPT = 64
_PEAKS_LOCK = threading.Lock()


def _peak(lowered: Any, device: Any) -> int:
  """The compiled peak of ``lowered`` for ``device``'s kind, compiled once
  per program in this process."""
  key = (hashlib.sha256(lowered.as_text().encode()).hexdigest(),
         device.platform, device.device_kind)
  with _PEAKS_LOCK:
    if key in _PEAKS:
      _PEAKS.move_to_end(key)
      return _PEAKS[key]
  peak = compiled_memory(lowered.compile()).peak
  with _PEAKS_LOCK:
    _PEAKS[key] = peak
    while len(_PEAKS) > _PEAKS_KEPT:
      _PEAKS.popitem(last=False)
  return peak


def choose(layout: StepPlan, lower: Callable[[Any], Any]) -> tuple[Any, str]:
  """The layout with the remat policy to trace the step with, and why.

  Args:
    layout: a ``StepPlan`` whose remat is ``AUTO``.
    lower: ``lower(layout)``, the step's ``Lowered`` for a layout.

  Returns:
    ``(layout, reason)``.
  """
  budget = (layout.decisions.device_memory_bytes or
            device_memory(layout.mesh.devices.flat[0]))
  tried = []
  for name in AUTO_CANDIDATES:
    candidate = layout.with_remat(RematPolicy(name))
    with jax.set_mesh(layout.mesh):
      peak = _peak(lower(candidate), layout.mesh.devices.flat[0])
    tried.append(f"{name} {peak / 2**30:.2f} GiB")
    if budget is None or peak <= budget:
      break
  fits = budget is None or peak <= budget
  limit = ("no known memory limit" if budget is None else
           f"{'fits' if fits else 'none fits'} {budget / 2**30:.2f} GiB")
  return candidate, (f"remat auto chose {candidate.remat.value} ({limit}; "
                     f"compiled peaks: {', '.join(tried)})")
