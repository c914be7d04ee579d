"""Everything that differs between the supported jax versions (0.10 to 0.12),
and the only module that reads JAX's internals.

The rest of the library calls these helpers and never tests
``jax.__version__`` nor imports ``jax._src`` itself. Each internal has a
fallback for a JAX that moved it, and tests/test_compat.py fails (rather
than the fallback silently taking over) when an installed JAX lacks one.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import jax


def varying_axes(x: Any) -> frozenset[str]:
  """The mesh axes ``x`` varies over inside ``shard_map`` (its type's
  ``manual_axis_type.varying``; ``vma`` in some versions)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))


def backends_started() -> bool | None:
  """Whether JAX's backends have started (devices listed, arrays made);
  None where this JAX cannot say."""
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):
    return None


def distributed_state() -> Any:
  """JAX's distributed-runtime state (its client, process id and count), or
  None where a JAX version has moved it."""
  try:
    from jax._src import distributed  # pylint: disable=g-import-not-at-top
    return distributed.global_state
  except (ImportError, AttributeError):
    return None


def cluster_kinds() -> list[Any] | None:
  """The cluster environments ``jax.distributed.initialize()`` knows how to
  bootstrap from (SLURM, Open MPI, ...), or None where a JAX version has
  moved them."""
  try:
    from jax._src import clusters  # pylint: disable=g-import-not-at-top
    # pylint: disable-next=protected-access
    return list(clusters.ClusterEnv._cluster_types)
  except (ImportError, AttributeError):
    return None


# The CUDA plugins' module names: a JAX that moved ``cuda_versions`` has one
# of these installed exactly when it can compile for NVIDIA GPUs.
_CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def cudnn_detected() -> bool:
  """Whether this JAX can trace cuDNN's fused attention: its CUDA plugin's
  ``cuda_versions`` is loaded. Without it (a plain ``pip install jax``),
  ``jax.nn.dot_product_attention(..., implementation="cudnn")`` raises
  ``RuntimeError: cuDNN is not detected.`` as soon as it is traced, even
  inside a ``lax.platform_dependent`` branch a CPU program never runs; and
  no program for an NVIDIA GPU can be compiled anyway."""
  try:
    # pylint: disable-next=g-import-not-at-top
    from jax._src.lib import cuda_versions
  except ImportError:
    return any(importlib.util.find_spec(name) is not None
               for name in _CUDA_PLUGINS)
  return cuda_versions is not None
