"""zero_jax: ZeRO (stages 0-3) for JAX as layouts plus explicit collectives."""

from zero_jax.config import ZeroConfig
from zero_jax.engine import Engine, TrainState
from zero_jax.layers import REMAT_POLICIES, scan_layers
from zero_jax.mesh import make_mesh
from zero_jax.plan import LeafPlan, Plan, plan_leaf

__all__ = [
    "Engine",
    "LeafPlan",
    "Plan",
    "REMAT_POLICIES",
    "TrainState",
    "ZeroConfig",
    "make_mesh",
    "plan_leaf",
    "scan_layers",
]
