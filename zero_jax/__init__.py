"""zero_jax: ZeRO (stages 0-3) for JAX as layouts plus explicit collectives.

The subpackages, in the order data flows through them:

- ``config``: ``ZeroConfig`` and the DeepSpeed JSON reader;
- ``layout``: the mesh, the plan (which dimension of each leaf is split over
  ``data``) and the placement (where each part of the state lives);
- ``materialize``: how a shard becomes a whole parameter inside
  ``shard_map``, and its gradient a shard again;
- ``layers``: per-layer ZeRO inside the model (``scan_layers``, ``layer``,
  the Flax adapters, the blocks found by themselves);
- ``offload``: updating state that lives in host memory;
- ``train``: the ``Engine``, its ``StepPlan`` and ``TrainState``, the jitted
  step;
- ``checkpoint``: orbax checkpoints that restore into any layout;
- ``distributed``: multi-process runs and the launcher;
- ``analysis``: estimated and measured memory and communication, and
  compiling for GPUs without one;
- ``metrics``: throughput, MFU, progress and logs;
- ``models``: the reference GPT.

The names below are the API most scripts need. Importing ``zero_jax`` loads
nothing else, not even JAX (which sets environment variables of its own when
imported): each name and subpackage is loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public name -> the subpackage that defines it.
_NAMES = {
    "Accumulation": "config",
    "Activations": "config",
    "Batch": "config",
    "CheckpointConflictError": "checkpoint",
    "CheckpointCorruptError": "checkpoint",
    "CheckpointWriteError": "checkpoint",
    "Checkpointer": "checkpoint",
    "Engine": "train",
    "StepPlan": "train",
    "LossScaleState": "train",
    "LossScaling": "config",
    "LossScope": "config",
    "MixedPrecision": "config",
    "NvmeOptions": "config",
    "Offload": "config",
    "REMAT_POLICIES": "config",
    "RematPolicy": "config",
    "StepFailedError": "train",
    "Tier": "config",
    "TrainState": "train",
    "UpdateOn": "config",
    "ZeroConfig": "config",
    "ZeroPP": "config",
    "checkpoint_name": "layers",
    "estimate_activations": "analysis",
    "estimate_comm": "analysis",
    "estimate_memory": "analysis",
    "export_params": "checkpoint",
    "from_deepspeed": "config",
    "initialize": "train",
    "layer": "layers",
    "load_params": "checkpoint",
    "make_mesh": "layout",
    "scan_layers": "layers",
    "scan_linen": "layers",
    "scan_nnx": "layers",
    "simulate_cpu_devices": "layout",
}
_SUBPACKAGES = ("analysis", "checkpoint", "config", "distributed", "layers",
                "layout", "materialize", "metrics", "models", "offload",
                "train")

__all__ = sorted([*_NAMES, "analysis", "distributed", "metrics", "models"])


def __getattr__(name: str) -> Any:
  if name in _NAMES:
    value = getattr(importlib.import_module(f"zero_jax.{_NAMES[name]}"), name)
  elif name in _SUBPACKAGES:
    value = importlib.import_module(f"zero_jax.{name}")
  else:
    raise AttributeError(f"module 'zero_jax' has no attribute {name!r}")
  globals()[name] = value  # (loaded once)
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_NAMES) | set(_SUBPACKAGES))


if TYPE_CHECKING:  # (what the names are, for type checkers and IDEs)
  from zero_jax import (analysis, checkpoint, config, distributed, layers,
                        layout, materialize, metrics, models, offload, train)
  from zero_jax.analysis import (estimate_activations, estimate_comm,
                                 estimate_memory)
  from zero_jax.checkpoint import (CheckpointConflictError,
                                   CheckpointCorruptError,
                                   CheckpointWriteError, Checkpointer,
                                   export_params, load_params)
  from zero_jax.config import (REMAT_POLICIES, Accumulation, Activations,
                               Batch, LossScaling, LossScope, MixedPrecision,
                               NvmeOptions, Offload, RematPolicy, Tier,
                               UpdateOn, ZeroConfig, ZeroPP, from_deepspeed)
  from zero_jax.layers import (checkpoint_name, layer, scan_layers,
                               scan_linen, scan_nnx)
  from zero_jax.layout import make_mesh, simulate_cpu_devices
  from zero_jax.train import (Engine, StepPlan, LossScaleState,
                              StepFailedError, TrainState, initialize)
