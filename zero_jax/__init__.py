"""zero_jax: ZeRO (stages 0-3) for JAX as layouts plus explicit collectives.

The modules by role, in the order data flows through them:

- configuration: ``config`` (``ZeroConfig``), ``deepspeed`` and
  ``deepspeed_keys`` (DeepSpeed JSON in), ``remat`` (policy names);
- layout: ``mesh`` (the ``data`` axis), ``plan`` (which dimension of each
  leaf is split), ``placement`` (where master, moments and the compute copy
  live, where the update runs: derived once from the config);
- state: ``state`` (``TrainState``), ``initial`` (building it),
  ``loss_scale`` (float16's scale and the skip count);
- the step: ``engine`` (lays out state, builds the step), ``step`` (the
  jitted step and its deferred checks), ``checks`` (state and batch
  validation), ``grads`` (loss and gradients per stage family),
  ``materialize`` (gather / gather-from / scatter: the one choice, shared
  with ``layers`` and ``flax_layers``, per-layer scans, and ``blocks``,
  blocks called in a loop), ``collectives``,
  ``update`` (unscale, norm, skip, clip, the optimizer update), ``stream``
  and ``separable`` (offloaded state updated slice by slice),
  ``host_update`` (the update as a program on the host's CPU devices);
- runtime: ``checkpoint`` (with ``checkpoint_compat``, ``checkpoint_files``,
  ``checkpoint_export``), ``distributed``, ``failfast``, ``launch``,
  ``metrics``, ``progress``;
- analysis: ``memory``, ``comm``, ``measure`` (with ``_checks``),
  ``estimate`` (the command line), ``aot`` (compiling for GPUs without
  one), ``hlo`` (collectives in compiled HLO), ``models`` (the reference
  GPT).
"""

import importlib as _importlib
import warnings as _warnings

from zero_jax import distributed, metrics
from zero_jax.blocks import layer
from zero_jax.checkpoint import (CheckpointWriteError, Checkpointer,
                                 export_params, load_params)
from zero_jax.config import ZeroConfig
from zero_jax.deepspeed import from_deepspeed
from zero_jax.engine import Engine, TrainState
from zero_jax.flax_layers import scan_linen, scan_nnx
from zero_jax.loss_scale import LossScaleState
from zero_jax.layers import REMAT_POLICIES, checkpoint_name, scan_layers
from zero_jax.memory import (estimate_activations, estimate_comm,
                             estimate_memory)
from zero_jax.mesh import make_mesh

__all__ = [
    "CheckpointWriteError",
    "Checkpointer",
    "Engine",
    "LossScaleState",
    "REMAT_POLICIES",
    "TrainState",
    "ZeroConfig",
    "checkpoint_name",
    "distributed",
    "estimate_activations",
    "estimate_comm",
    "estimate_memory",
    "export_params",
    "from_deepspeed",
    "layer",
    "load_params",
    "make_mesh",
    "metrics",
    "scan_layers",
    "scan_linen",
    "scan_nnx",
]

# Internals that were exported before; each warns for one release.
_MOVED = {"Plan": "zero_jax.plan", "LeafPlan": "zero_jax.plan",
          "plan_leaf": "zero_jax.plan", "remat_policy": "zero_jax.remat"}


def __getattr__(name: str):
  if name in _MOVED:
    _warnings.warn(f"zero_jax.{name} is internal and leaves the top-level API "
                   f"in the next release: use {_MOVED[name]}.{name}",
                   DeprecationWarning, stacklevel=2)
    return getattr(_importlib.import_module(_MOVED[name]), name)
  raise AttributeError(f"module 'zero_jax' has no attribute {name!r}")
