"""Layout: the mesh, which dimension of each leaf is split over ``data``
(the plan; over ``model`` as the user's model says: ``model_specs``), and
where each part of the state lives (the placement).

Data flows config -> mesh -> decisions (``decide``: the one reader of the
config, each choice with its reason, the placement among them) -> plan;
everything the train step does follows from them.
"""

from zero_jax.layout._decide import Decisions, decide, decide_placement
from zero_jax.layout._mesh import (DATA, MODEL, REPLICA, make_mesh,
                                   simulate_cpu_devices)
from zero_jax.layout._model_specs import model_specs
from zero_jax.layout._placement import (ComputeCopy, GatherFrom, Materialize,
                                        Memory, Placement, Prefetch,
                                        UpdateKind)
from zero_jax.layout._plan import LeafPlan, Plan, plan_leaf

__all__ = [
    "DATA",
    "MODEL",
    "REPLICA",
    "ComputeCopy",
    "Decisions",
    "GatherFrom",
    "LeafPlan",
    "Materialize",
    "Memory",
    "Placement",
    "Plan",
    "Prefetch",
    "UpdateKind",
    "decide",
    "decide_placement",
    "make_mesh",
    "model_specs",
    "plan_leaf",
    "simulate_cpu_devices",
]
