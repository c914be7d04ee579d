"""zero_jax: ZeRO (stages 0-3) for JAX as layouts plus explicit collectives."""

from zero_jax import distributed, metrics
from zero_jax.checkpoint import (CheckpointWriteError, Checkpointer,
                                 export_params, load_params)
from zero_jax.config import ZeroConfig
from zero_jax.deepspeed import from_deepspeed
from zero_jax.engine import Engine, TrainState
from zero_jax.flax_layers import scan_linen, scan_nnx
from zero_jax.loss_scale import LossScaleState
from zero_jax.layers import (REMAT_POLICIES, checkpoint_name, remat_policy,
                             scan_layers)
from zero_jax.memory import (estimate_activations, estimate_comm,
                             estimate_memory)
from zero_jax.mesh import make_mesh
from zero_jax.plan import LeafPlan, Plan, plan_leaf

__all__ = [
    "CheckpointWriteError",
    "Checkpointer",
    "Engine",
    "LeafPlan",
    "LossScaleState",
    "Plan",
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
    "load_params",
    "make_mesh",
    "metrics",
    "plan_leaf",
    "remat_policy",
    "scan_layers",
    "scan_linen",
    "scan_nnx",
]
