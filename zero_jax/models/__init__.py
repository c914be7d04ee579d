"""Reference models: the GPT the demo, the benchmarks and the estimator use
(scanned layers), and GPTs written with their blocks in a Python loop."""

from zero_jax.models._gpt import (ATTENTIONS, BLOCK_PARAMS, GPT, GPTConfig,
                                  block, layer_norm, make_loss_fn)
from zero_jax.models._loop_gpt import loop_gpt
from zero_jax.models._xent import chunked_cross_entropy

__all__ = [
    "ATTENTIONS",
    "BLOCK_PARAMS",
    "GPT",
    "GPTConfig",
    "block",
    "chunked_cross_entropy",
    "layer_norm",
    "loop_gpt",
    "make_loss_fn",
]
