"""Step memory of transformers whose blocks are called in a Python loop.

Compiles (never runs) the train step of a GPT written the way Flax's examples
write it, NNX blocks in a list and Linen blocks made in a loop, for 8 H100s
(``zero_jax.analysis``, no GPU needed), bf16 compute, fp32 AdamW: stages 1-3,
stage 3 with the blocks run whole (``layer_classes=()``, what such a model
got before blocks were run one at a time), and the same model scanned (``scan_nnx``,
``scan_linen``). Prints a markdown table of the compiled temporaries::

  PYTHONPATH=. python experiments/block_memory.py [--out PATH.md]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

import zero_jax as zj
from zero_jax import analysis
from zero_jax.models import loop_gpt

from _report import emit  # experiments/_report.py, beside this script

VOCAB, D, HEADS, LAYERS, BATCH, SEQ = 512, 256, 4, 8, 32, 64


def temp_mib(framework, stage, scanned=False, layer_classes=None) -> float:
  loss_fn, params = loop_gpt(framework, vocab=VOCAB, d=D, heads=HEADS,
                             layers=LAYERS, scanned=scanned)
  # Stage 2 with its replicated bf16 copy, as the paper lays it out (its
  # default, prefetch, gathers the master in forward instead, which moves
  # that copy from the arguments into the temporaries counted here).
  engine = zj.Engine(loss_fn, optax.adamw(1e-3), zj.ZeroConfig(
      stage=stage, compute_dtype="bfloat16", layer_classes=layer_classes,
      prefetch=False if stage == 2 else "auto"),
                     analysis.gpu_mesh("h100", 8))
  batch = {k: jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32) for k in "xy"}
  c = analysis.compile_step(engine, jax.eval_shape(lambda: params), batch)
  return c.memory.temp / 2**20, c.params


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=None, metavar="PATH.md")
  args = p.parse_args()
  rows = ["| model | Ψ | stage 1 | stage 2 | stage 3, blocks whole "
          "(`layer_classes=()`) | stage 3 | stage 3 scanned |",
          "|---|---|---|---|---|---|---|"]
  for framework in ("nnx", "linen"):
    s1, psi = temp_mib(framework, 1)
    s2, _ = temp_mib(framework, 2)
    off, _ = temp_mib(framework, 3, layer_classes=())
    s3, _ = temp_mib(framework, 3)
    scan, _ = temp_mib(framework, 3, scanned=True)
    rows.append(f"| {framework}, {LAYERS} blocks in a loop | {psi:,} | "
                f"{s1:.2f} | {s2:.2f} | {off:.2f} ({off / s1:.2f}x stage 1)"
                f" | {s3:.2f} ({s3 / s1:.2f}x) | {scan:.2f} |")
    print(rows[-1], flush=True)
  text = (f"# Blocks in a Python loop: compiled step temp per device (MiB)\n\n"
          f"`python experiments/block_memory.py`: GPT d_model {D}, {LAYERS} "
          f"blocks, {HEADS} heads, vocabulary {VOCAB}, batch {BATCH} x "
          f"{SEQ}, bf16 compute, fp32 AdamW, compiled for 8 H100s "
          f"(jax {jax.__version__}).\n\n" + "\n".join(rows) + "\n")
  emit(text, args.out)


if __name__ == "__main__":
  main()
