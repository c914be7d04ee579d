"""Layout: the mesh, which dimension of each leaf is split over ``data``
(the plan; over ``model`` as the user's model says: ``model_specs``), and
where each part of the state lives (the placement).

Data flows config -> mesh -> decisions (``decide``: the one reader of the
config, each choice with its reason, the placement among them) -> plan;
everything the train step does follows from them.
"""

from zero_jax.layout._decide import (BatchSizes, Decisions, check_mesh,
                                     decide, decide_placement)
from zero_jax.layout._mesh import (DATA, MODEL, REPLICA, auto_model_size,
                                   batch_axes, layout_mesh, make_mesh, replica_axes,
                                   simulate_cpu_devices)
from zero_jax.layout._model_specs import (LeafSpec, is_model_parallel,
                                          model_specs)
from zero_jax.layout._placement import (ComputeCopy, GatherFrom, Materialize,
                                        Memory, Placement, Prefetch,
                                        Quantize, UpdateKind)
from zero_jax.layout._plan import (LeafPlan, Plan, flat, is_plan, map_leaves,
                                   plan_leaf)

__all__ = [
    "BatchSizes",
    "Decisions",
    "check_mesh",
    "decide",
    "decide_placement",
    "ComputeCopy",
    "DATA",
    "GatherFrom",
    "LeafPlan",
    "LeafSpec",
    "Materialize",
    "MODEL",
    "Memory",
    "Placement",
    "Plan",
    "Prefetch",
    "Quantize",
    "REPLICA",
    "UpdateKind",
    "auto_model_size",
    "batch_axes",
    "flat",
    "is_model_parallel",
    "is_plan",
    "layout_mesh",
    "make_mesh",
    "map_leaves",
    "model_specs",
    "plan_leaf",
    "replica_axes",
    "simulate_cpu_devices",
]
