"""How a sharded parameter becomes whole inside ``shard_map``, and its
gradient a shard again.

The per-leaf collectives over ``data`` (all-gather, reduce-scatter, and the
custom-VJP pairs of the two; ZeRO++'s int8 blocks for them; hpZ's
two-level gather, whose secondary copy remat keeps by its name
``SECONDARY``) live in this package's private modules, which the layer
helpers and the train step import. Its names: the ``Materializer`` that
chooses among them for a placement, the same gathers written as sharding
constraints for a loss of global meaning (``gather_constrained``,
``use_constrained``), and the ``LossContext`` through which the train step
tells the layer helpers which arrays it handed to ``loss_fn``.
"""

from zero_jax.materialize._constrained import (gather_constrained,
                                              use_constrained)
from zero_jax.materialize._context import LossContext
from zero_jax.materialize._hierarchical import SECONDARY
from zero_jax.materialize._materializer import Materializer

__all__ = [
    "LossContext",
    "Materializer",
    "SECONDARY",
    "gather_constrained",
    "use_constrained",
]
