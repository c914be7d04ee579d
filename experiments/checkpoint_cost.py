"""What the checkpoint's checksums cost, on the demo's checkpoint.

``Checkpointer.save`` records a checksum of every array (numpy over host
memory, one jitted pass over accelerator memory) and ``restore`` verifies
them. This times, for the demo's CPU model (``experiments/train_gpt.py``'s
``cpu`` preset: GPT d_model 128, 4 layers, sequence 64, AdamW, stage 3) on
8 simulated CPU devices, a save (started and committed) and a restore, each
with the checksum's part measured alone, and writes the table to
``experiments/results/checkpoint_checksum_cpu.md``::

  python experiments/checkpoint_cost.py
  python experiments/checkpoint_cost.py --repeats 3 --out-dir /tmp/cost
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
from flax import nnx
import optax

import zero_jax as zj
from zero_jax.checkpoint import array_checksums
from zero_jax.models import GPT, GPTConfig


def _timed(fn) -> float:
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--out-dir", default=os.path.join(
      os.path.dirname(os.path.abspath(__file__)), "results"))
  args = p.parse_args()
  if args.repeats < 1:
    p.error(f"--repeats {args.repeats}: give at least 1")

  config = GPTConfig(seq_len=64, d_model=128, n_layers=4, n_heads=4)
  graphdef, params = nnx.split(GPT(config, rngs=nnx.Rngs(0)), nnx.Param)
  del graphdef  # (the state is what a checkpoint holds; no step runs)
  engine = zj.Engine(lambda p, b: 0.0, optax.adamw(3e-3),
                     zj.ZeroConfig(stage=3), zj.make_mesh(8))
  state = engine.init(params)
  tree = {"state": {k: getattr(state, k)
                    for k in ("step", "params", "opt_state", "rng")}}
  n_bytes = sum(x.nbytes for x in jax.tree.leaves(tree))

  first_sum = _timed(lambda: array_checksums(tree))  # (compiles)
  sums, saves, restores = [], [], []
  root = tempfile.mkdtemp(prefix="checkpoint_cost_")
  try:
    for i in range(args.repeats + 1):
      directory = os.path.join(root, str(i))
      ckpt = zj.Checkpointer(directory)

      def save():
        ckpt.save(state)
        ckpt.wait()

      t_save = _timed(save)
      ckpt.close()
      reader = zj.Checkpointer(directory, read_only=True)
      t_restore = _timed(lambda: jax.block_until_ready(
          reader.restore(engine, params)))
      reader.close()
      t_sum = _timed(lambda: array_checksums(tree))
      if i:  # (the first round warms orbax and the restore's programs)
        saves.append(t_save)
        restores.append(t_restore)
        sums.append(t_sum)
  finally:
    shutil.rmtree(root, ignore_errors=True)

  med = statistics.median
  s, save_t, restore_t = med(sums), med(saves), med(restores)
  rows = [
      ("save (started and committed)", save_t, s / (save_t - s)),
      ("restore (read and verified)", restore_t, s / (restore_t - s)),
  ]
  lines = [
      "# Checkpoint checksum cost (demo checkpoint, 8 CPU devices)", "",
      f"`python experiments/checkpoint_cost.py` (jax {jax.__version__}; "
      f"{jax.device_count()} x {jax.devices()[0].platform}). The demo's CPU "
      f"model (GPT d_model 128, 4 layers, AdamW, stage 3): "
      f"{len(jax.tree.leaves(tree))} arrays, {n_bytes / 2**20:.2f} MiB. "
      f"Medians of {args.repeats} rounds; the checksum, timed alone, "
      "reads host memory with numpy on CPU devices (one jitted pass in "
      "accelerator memory); its first call took "
      f"{first_sum * 1e3:.1f} ms.", "",
      "| operation | time (ms) | checksum (ms) | checksum's cost |",
      "|---|---|---|---|"]
  for name, total, frac in rows:
    lines.append(f"| {name} | {total * 1e3:.1f} | {s * 1e3:.2f} | "
                 f"{frac:.1%} |")
  text = "\n".join(lines) + "\n"
  os.makedirs(args.out_dir, exist_ok=True)
  with open(os.path.join(args.out_dir, "checkpoint_checksum_cpu.md"),
            "w") as f:
    f.write(text)
  sys.stdout.write(text)


if __name__ == "__main__":
  main()
