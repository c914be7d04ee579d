"""Layout: the mesh, which dimension of each leaf is split over ``data``
(the plan), and where each part of the state lives (the placement).

Data flows config -> mesh -> plan and placement; everything the train step
does follows from these three decisions.
"""

from zero_jax.layout._mesh import (DATA, REPLICA, batch_axes, layout_mesh,
                                   make_mesh, replica_axes,
                                   simulate_cpu_devices)
from zero_jax.layout._placement import (ComputeCopy, GatherFrom, Materialize,
                                        Memory, Placement, UpdateKind)
from zero_jax.layout._plan import (LeafPlan, Plan, flat, is_plan, map_leaves,
                                   plan_leaf)

__all__ = [
    "ComputeCopy",
    "DATA",
    "GatherFrom",
    "LeafPlan",
    "Materialize",
    "Memory",
    "Placement",
    "Plan",
    "REPLICA",
    "UpdateKind",
    "batch_axes",
    "flat",
    "is_plan",
    "layout_mesh",
    "make_mesh",
    "map_leaves",
    "plan_leaf",
    "replica_axes",
    "simulate_cpu_devices",
]
