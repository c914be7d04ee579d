"""Layers: per-layer ZeRO inside the user's model.

``scan_layers`` (stacked layers in a scan), ``layer`` (one block called in
a loop), the Flax adapters ``scan_nnx`` and ``scan_linen``, and the blocks
the engine finds (``find_units``) and runs one at a time by itself.
"""

from jax.ad_checkpoint import checkpoint_name

from zero_jax.layers._flax import scan_linen, scan_nnx
from zero_jax.layers._layer import layer
from zero_jax.layers._prefetch import (
    COMPILER_OPTIONS as PREFETCH_COMPILER_OPTIONS,
    GLOBAL_COMPILER_OPTIONS as GLOBAL_PREFETCH_COMPILER_OPTIONS)
from zero_jax.layers._remat import remat_policy
from zero_jax.layers._scan import scan_layers
from zero_jax.layers._units import find_units

__all__ = [
    "GLOBAL_PREFETCH_COMPILER_OPTIONS",
    "PREFETCH_COMPILER_OPTIONS",
    "checkpoint_name",
    "find_units",
    "layer",
    "remat_policy",
    "scan_layers",
    "scan_linen",
    "scan_nnx",
]
