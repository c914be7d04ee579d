"""What the Flax adapters save: a stacked NNX model, nnx.scan vs zj.scan_nnx.

Compiles (never runs) the train step of a residual-MLP stack under each ZeRO
stage, with its layers scanned by ``nnx.scan`` (the engine can only gather
or scatter the whole model) and by ``zj.scan_nnx`` (one layer at a time),
and prints per-device temp and peak bytes of the compiled step::

  python experiments/adapter_memory.py
  python experiments/adapter_memory.py --d-model 256 --layers 16
"""

import argparse

import jax
import numpy as np
import optax
from flax import nnx

import zero_jax as zj
from zero_jax.analysis import compiled_memory, param_count

zj.simulate_cpu_devices(8)  # before anything lists devices


class Block(nnx.Module):
  """Pre-LN residual MLP."""

  def __init__(self, d: int, *, rngs: nnx.Rngs):
    self.ln = nnx.LayerNorm(d, rngs=rngs)
    self.up = nnx.Linear(d, 4 * d, rngs=rngs)
    self.down = nnx.Linear(4 * d, d, rngs=rngs)

  def __call__(self, x):
    return x + self.down(jax.nn.gelu(self.up(self.ln(x))))


class Model(nnx.Module):

  def __init__(self, d: int, n_layers: int, adapter: bool, *,
               rngs: nnx.Rngs):
    @nnx.vmap(in_axes=0, out_axes=0)
    def create(rngs):
      return Block(d, rngs=rngs)

    self.blocks = create(rngs.split(n_layers))
    self.head = nnx.Linear(d, 1, rngs=rngs)
    self.adapter = adapter

  def __call__(self, x):
    if self.adapter:
      h = zj.scan_nnx(self.blocks, x)
    else:
      h = nnx.scan(lambda h, block: block(h), in_axes=(nnx.Carry, 0),
                   out_axes=nnx.Carry)(x, self.blocks)
    return self.head(h)


def measure(d: int, n_layers: int, stage: int, adapter: bool, batch: int):
  graphdef, params = nnx.split(Model(d, n_layers, adapter,
                                     rngs=nnx.Rngs(0)), nnx.Param)

  def loss_fn(p, b):
    return ((nnx.merge(graphdef, p)(b["x"]) - b["y"]) ** 2).mean()

  engine = zj.Engine(loss_fn, optax.adam(1e-3), zj.ZeroConfig(stage=stage),
                     zj.make_mesh())
  rng = np.random.default_rng(0)
  b = {"x": rng.normal(size=(batch, d)).astype(np.float32),
       "y": rng.normal(size=(batch, 1)).astype(np.float32)}
  compiled = engine.step.lower(engine.init(params), b).compile()
  return param_count(params), compiled_memory(compiled)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--d-model", type=int, default=128)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--batch", type=int, default=64)
  args = p.parse_args()
  mib = lambda x: f"{x / 2**20:.2f}"
  print(f"residual MLP, d {args.d_model}, {args.layers} layers, "
        f"{len(jax.devices())} devices, adam; MiB per device")
  print(f"{'stage':>5} | {'layers run by':<12} | {'temp':>6} | {'peak':>6}")
  for stage in (1, 2, 3):
    for adapter in (False, True):
      psi, mem = measure(args.d_model, args.layers, stage, adapter,
                         args.batch)
      name = "zj.scan_nnx" if adapter else "nnx.scan"
      print(f"{stage:>5} | {name:<12} | {mib(mem.temp):>6} | "
            f"{mib(mem.peak):>6}")
  print(f"Ψ = {psi:,}")


if __name__ == "__main__":
  main()
