"""Everything that differs between the supported jax versions (0.10 to 0.12).

The rest of the library calls these helpers and never tests
``jax.__version__`` itself.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.experimental import compute_on as _compute_on

# jax 0.10 has ``compute_on(compute_type)``, a context manager, and the
# function form as ``compute_on2``; from 0.11 on ``compute_on`` is the
# function form: ``compute_on(f, *, compute_type, out_memory_spaces)``.
_COMPUTE_ON_FN = getattr(_compute_on, "compute_on2", None)


def on_host(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` compiled to run on the host, inside a jitted step.

  Its outputs are left in host memory; the caller's ``out_shardings`` (or
  a ``device_put``) move them where they belong.

  Args:
    fn: a function of arrays.

  Returns:
    ``fn`` under ``compute_on("device_host")``.
  """
  if _COMPUTE_ON_FN is not None:  # jax 0.10
    return _compute_on.compute_on("device_host")(jax.jit(fn))
  return _compute_on.compute_on(fn, compute_type="device_host",
                                out_memory_spaces=jax.memory.Space.Host)


def is_compile_only(device: jax.Device) -> bool:
  """True for devices that can compile but not run, e.g. those of
  ``jax.experimental.topologies`` (a GPU described, not present): they have
  no addressable memories."""
  try:
    return not device.addressable_memories()
  except Exception:  # pylint: disable=broad-except
    return True
