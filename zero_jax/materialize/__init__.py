"""How a sharded parameter becomes whole inside ``shard_map``, and its
gradient a shard again.

The per-leaf collectives over ``data`` (all-gather, reduce-scatter, and the
custom-VJP pairs of the two; ZeRO++'s int8 blocks for them; hpZ's
two-level gather), the ``Materializer`` that chooses among them for a
placement, and the ``LossContext`` through which the train step tells
the layer helpers which arrays it handed to ``loss_fn``.
"""

from zero_jax.materialize._collectives import (cast, dequantize_blocks,
                                               gather_from, gather_leaf,
                                               gather_leaves,
                                               gather_replicated, psum_leaf,
                                               quantize_blocks, reduce_leaf,
                                               reduce_tree,
                                               use_with_scattered_grad, zeros)
from zero_jax.materialize._constrained import (gather_constrained,
                                              use_constrained)
from zero_jax.materialize._hierarchical import (SECONDARY,
                                                gather_hierarchical)
from zero_jax.materialize._context import (LossContext, current,
                                           handing_over)
from zero_jax.materialize._materializer import (KEPT, HandedParam,
                                                Materializer,
                                                materialize_together)

__all__ = [
    "KEPT",
    "SECONDARY",
    "HandedParam",
    "LossContext",
    "Materializer",
    "cast",
    "current",
    "dequantize_blocks",
    "gather_constrained",
    "gather_from",
    "gather_hierarchical",
    "gather_leaf",
    "gather_leaves",
    "gather_replicated",
    "handing_over",
    "materialize_together",
    "psum_leaf",
    "quantize_blocks",
    "reduce_leaf",
    "reduce_tree",
    "use_constrained",
    "use_with_scattered_grad",
    "zeros",
]
