"""What gradient accumulation costs in memory, per stage.

Compiles (never runs) the GPT train step at a fixed micro-batch (2 sequences
per device) without accumulation and with ``grad_accum_steps=K``, and prints
how much the compiled step's temporaries grow: the accumulator. Stages 0-1
accumulate each device's full gradient, stages 2-3 only its reduce-scattered
shard::

  python experiments/accum_memory.py
  python experiments/accum_memory.py --d-model 256 --accum 8
"""

import argparse

import numpy as np
import optax
from flax import nnx

import zero_jax as zj
from zero_jax.analysis import compiled_memory, param_count
from zero_jax.models import GPT, GPTConfig, make_loss_fn

zj.simulate_cpu_devices(8)  # before anything lists devices


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--seq-len", type=int, default=16)
  p.add_argument("--accum", type=int, default=4)
  p.add_argument("--devices", type=int, default=8)
  args = p.parse_args()

  cfg = GPTConfig(vocab_size=64, seq_len=args.seq_len, d_model=args.d_model,
                  n_layers=args.layers, n_heads=4)
  graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  loss_fn = make_loss_fn(graphdef)
  psi, n = param_count(params), args.devices
  mesh = zj.make_mesh(num_devices=n)

  def temp(stage, accum):
    engine = zj.Engine(loss_fn, optax.adamw(1e-3),
                       zj.ZeroConfig(stage=stage, grad_accum_steps=accum),
                       mesh)
    batch = {"tokens": np.zeros((2 * n * accum, args.seq_len + 1), np.int32)}
    lowered = engine.step.lower(engine.init(params), batch)
    return compiled_memory(lowered.compile()).temp

  print(f"GPT d_model {args.d_model}, {args.layers} layers, Ψ = {psi:,}, "
        f"{n} devices, 2 sequences per device per micro-batch; temp of the "
        "compiled step (MiB)")
  head = (f"{'stage':>5} | {'accum 1':>8} | {f'accum {args.accum}':>8} | "
          f"{'extra':>7} | {'extra / shard (4Ψ/N)':>20} | "
          f"{'extra / full (4Ψ)':>17}")
  print(head)
  print("-" * len(head))
  for stage in range(4):
    one, k = temp(stage, 1), temp(stage, args.accum)
    extra = k - one
    print(f"{stage:>5} | {one / 2**20:>8.2f} | {k / 2**20:>8.2f} | "
          f"{extra / 2**20:>7.2f} | {extra / (4 * psi / n):>20.2f} | "
          f"{extra / (4 * psi):>17.2f}")


if __name__ == "__main__":
  main()
