"""Reference models: the GPT the demo, the benchmarks and the estimator use
(scanned layers; grouped-query heads and rotary positions where asked, in
Llama 3 8B's shape with ``llama3_8b``), and GPTs written with their blocks
in a Python loop; the reference GPT's train step compiled for GPUs you do
not have (``compile_gpt``, from shapes alone: ``gpt_shapes``) and its
GSPMD FSDP peer (``compile_gspmd_gpt``, with the loss
``pinned_gpt_loss``)."""

from zero_jax.models._compiled import (compile_gpt, compile_gspmd_gpt,
                                       gpt_shapes, pinned_gpt_loss)
from zero_jax.models._gpt import (GPT, GPTConfig, block, llama3_8b,
                                  make_loss_fn)
from zero_jax.models._loop_gpt import loop_gpt
from zero_jax.models._xent import chunked_cross_entropy

__all__ = [
    "GPT",
    "GPTConfig",
    "block",
    "chunked_cross_entropy",
    "compile_gpt",
    "compile_gspmd_gpt",
    "gpt_shapes",
    "llama3_8b",
    "loop_gpt",
    "make_loss_fn",
    "pinned_gpt_loss",
]
