"""What each remat policy costs on one H100, and what ``remat="auto"`` picks.

Compiles (never runs) the reference GPT's stage-3 train step for one H100
(``zero_jax.analysis``, no GPU needed): vocabulary 50304, sequence 1024, batch
16, bf16 compute, fp32 AdamW, cuDNN attention (the GPT's default on a GPU),
the loss whole and chunked (``loss_chunk=1024``), at every policy that
``remat="auto"`` may choose. Prints a markdown table of the compiled peak
and temporaries per device and the cuDNN attention forwards per layer (2:
backward runs the forward again), then the policy auto picks for an H100's
memory and for JAX's default 75% of it::

  PYTHONPATH=. python experiments/remat_memory.py [--out PATH.md]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import zero_jax as zj
from zero_jax import analysis
from zero_jax.models import GPT, GPTConfig, make_loss_fn

from _report import emit  # experiments/_report.py, beside this script

# name: (d_model, n_layers, n_heads)
SIZES = {"125m": (768, 12, 12), "1.3b": (2048, 24, 16)}
BATCH, SEQ, VOCAB = 16, 1024, 50304
POLICIES = ("full", "attention_saveable", "dots_saveable",
            "dots_attention_saveable", "none")
_FORWARD = 'custom_call_target="__cudnn$fmhaSoftmax"'


def compile_step(size: str, remat: str, loss_chunk: int | None,
                 budget: int | None = None):
  """``(engine, CompiledStep)`` of the GPT of ``size`` on one H100."""
  d, layers, heads = SIZES[size]
  cfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=d, n_layers=layers,
                  n_heads=heads, loss_chunk=loss_chunk)
  graphdef, params = nnx.split(
      nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  engine = zj.Engine(
      make_loss_fn(graphdef), optax.adamw(1e-4, b1=0.9, b2=0.95,
                                          weight_decay=0.1),
      zj.ZeroConfig(stage=3, compute_dtype="bfloat16", remat=remat,
                    device_memory_bytes=budget),
      analysis.gpu_mesh("h100", 1))
  batch = {"tokens": jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)}
  return engine, analysis.compile_step(engine, params, batch)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=None, metavar="PATH.md")
  p.add_argument("--sizes", nargs="*", default=list(SIZES),
                 choices=list(SIZES))
  args = p.parse_args()
  gib = 2**30
  rows = ["| GPT | remat | peak GiB (loss whole) | peak GiB (chunked) | "
          "temp GiB (chunked) | cuDNN forwards per layer |",
          "|---|---|---|---|---|---|"]
  picks = []
  for size in args.sizes:
    for remat in POLICIES:
      _, whole = compile_step(size, remat, None)
      _, chunked = compile_step(size, remat, 1024)
      # One scan body forward, one backward: forwards in the program.
      forwards = chunked.hlo.count(_FORWARD)
      rows.append(f"| {size} | `{remat}` | {whole.memory.peak / gib:.2f} | "
                  f"{chunked.memory.peak / gib:.2f} | "
                  f"{chunked.memory.temp / gib:.2f} | {forwards} |")
      print(rows[-1], flush=True)
    h100 = analysis.device_memory(analysis.gpu_devices("h100", 1)[0])
    for label, budget in (("an H100 (79.11 GiB)", None),
                          ("75% of an H100 (JAX's default preallocation)",
                           int(0.75 * h100))):
      engine, _ = compile_step(size, "auto", 1024, budget)
      picks.append(f"- {size}, {label}: {engine.remat_reason}")
      print(picks[-1], flush=True)
  text = ("# Remat policies on one H100: compiled step memory\n\n"
          "`PYTHONPATH=. python experiments/remat_memory.py`: GPT, "
          f"vocabulary {VOCAB}, batch {BATCH} x {SEQ}, bf16 compute, fp32 "
          "AdamW, stage 3, cuDNN attention, compiled for one H100 "
          f"(jax {jax.__version__}). Chunked: `loss_chunk=1024`.\n\n"
          + "\n".join(rows) + "\n\n`remat=\"auto\"` (chunked loss):\n\n"
          + "\n".join(picks) + "\n")
  emit(text, args.out)


if __name__ == "__main__":
  main()
