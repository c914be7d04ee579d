"""Tests of programs compiled for NVIDIA GPUs (``zero_jax.analysis``).

They need JAX's CUDA plugin (the test extra installs it on Linux), never a
GPU. Without the plugin they are skipped for a missing backend, never for a
missing feature; CI sets ZERO_JAX_REQUIRE_GPU_COMPILE, which turns a missing
plugin into an error instead.
"""

import importlib.util
import os

import pytest

from zero_jax.analysis._aot import INSTALL_HINT

AVAILABLE = importlib.util.find_spec("jax_cuda12_plugin") is not None
if not AVAILABLE and os.environ.get("ZERO_JAX_REQUIRE_GPU_COMPILE"):
  raise ImportError("JAX's CUDA plugin is missing: " + INSTALL_HINT)

# Marks a test (or, as ``pytestmark``, a module) that compiles for GPUs.
compiles_for_gpus = pytest.mark.skipif(
    not AVAILABLE, reason="JAX's CUDA plugin is not installed (Linux only): "
    + INSTALL_HINT)
