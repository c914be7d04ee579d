"""A model whose optimizer state is larger than this machine's RAM, trained
with the NVMe tier (``offload_optimizer="nvme"``) on CPU devices.

The reference GPT at about 2.2B parameters: its fp32 master and AdamW's two
moments (12 bytes a parameter, about 26 GB) live in files under
``--nvme-path``, two versions of them (about 53 GB of disk). Host RAM holds
the bf16 compute copy, the gradients and ``buffer_count`` slices. The run
reports each step's time, the tier's read and write bandwidth, and the
process's peak RSS (``ru_maxrss``) against the state's size.

Then a smaller twin (the same shape scaled down, ``--twin-params``) trains
the same batches with the NVMe tier and with the host tier
(``offload_optimizer="host"``): their losses must be equal, bit for bit.

The parameters are made in bf16 a leaf at a time (a fp32 copy of 2.2B
parameters would be 8.8 GB by itself) and freed once the engine has
written them to its files.

On CPU devices the device's memory is host RAM, so the peak RSS holds
the step's program too: the bf16 compute copy, the gradients and XLA's
temporaries. XLA:CPU has no bf16 matmul: it converts each weight to
float32, and its loop-invariant code motion hoists those converts out of
the layer scan, so a float32 copy of every stacked weight lives through
the step (4.4 bytes a parameter of temporaries; 0.4 without the pass).
GPUs multiply bf16 natively and hoist no such copy. The run turns that
one pass off (``--xla_disable_hlo_passes=while-loop-invariant-code-motion``,
added to ``XLA_FLAGS``; ``--keep-licm`` keeps it).

::

  PYTHONPATH=. python experiments/nvme_over_ram.py --nvme-path /tmp/nvme
  PYTHONPATH=. python experiments/nvme_over_ram.py --nvme-path /tmp/nvme \\
      --out experiments/results/nvme_over_ram_cpu.md
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import time

import numpy as np


def _rss_gib() -> float:
  """The process's peak resident set so far, GiB (Linux: KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _now_rss_gib() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def _shape(params: float, heads: int) -> tuple[int, int]:
  """(d_model, layers) of a GPT of about ``params`` (12 L d^2)."""
  layers = max(2, round((params / 12 / 100**2) ** (1 / 3) / 1.1))
  d = int(round((params / (12 * layers)) ** 0.5 / (heads * 8))) * heads * 8
  return d, layers


def _model(zj, params_b: float, seq: int):
  """(graphdef, bf16 params, GPTConfig) of a GPT of about ``params_b``
  billion parameters, its leaves made one at a time."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from zero_jax.models import GPT, GPTConfig
  heads = 16
  d, layers = _shape(params_b * 1e9, heads)
  cfg = GPTConfig(vocab_size=256, seq_len=seq, d_model=d, n_layers=layers,
                  n_heads=heads, remat="full")
  abstract = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
  graphdef, shapes = nnx.split(abstract, nnx.Param)
  flat, tree = jax.tree_util.tree_flatten_with_path(shapes)
  rng = np.random.default_rng(0)
  leaves = []
  for path, s in flat:
    name = str(path[-2] if len(path) > 1 else path[-1])
    x = np.empty(s.shape, jnp.bfloat16)
    if "scale" in name or "bias" in name:
      x[...] = 1 if "scale" in name else 0
    else:
      # (Row by row: no float32 copy of a whole leaf.)
      rows = x.reshape(-1, s.shape[-1])
      for r in range(0, rows.shape[0], 4096):
        rows[r:r + 4096] = 0.02 * rng.standard_normal(
            rows[r:r + 4096].shape, np.float32)
    leaves.append(jax.device_put(x))
    del x
  return graphdef, jax.tree.unflatten(tree, leaves), cfg


def _batches(steps: int, batch: int, seq: int) -> list:
  rng = np.random.default_rng(0)
  return [{"tokens": rng.integers(0, 256, (batch, seq + 1), np.int32)}
          for _ in range(steps)]


def _engine(zj, graphdef, where: str, path: str | None, args):
  from zero_jax import models, offload
  kw = {}
  if where == "nvme":
    kw = dict(nvme_path=path, nvme=zj.NvmeOptions(
        slice_bytes=args.slice_mib * 2**20, buffer_count=args.buffers,
        resume=False))
  config = zj.ZeroConfig(stage=3, compute_dtype="bfloat16",
                         offload_optimizer=where, update_on="host",
                         min_shard_elements=0, clip_grad_norm=1.0, **kw)
  return zj.Engine(models.make_loss_fn(graphdef),
                   offload.adamw(1e-4, weight_decay=0.1), config,
                   zj.make_mesh(num_devices=args.devices))


def _train(zj, engine, params, batches, drop_params: bool = False):
  """(losses, seconds per step, the tier) after training ``batches``."""
  import jax
  start = time.perf_counter()
  state = engine.init(params)
  jax.block_until_ready(state.compute_params)
  init_s = time.perf_counter() - start
  print(f"  init: {init_s:.1f} s, RSS now {_now_rss_gib():.2f} GiB, peak "
        f"{_rss_gib():.2f} GiB", flush=True)
  if drop_params:
    for x in jax.tree.leaves(params):
      x.delete()
  losses, seconds = [], []
  for b in batches:
    t = time.perf_counter()
    state, metrics = engine.step(state, b)
    losses.append(float(metrics["loss"]))
    seconds.append(time.perf_counter() - t)
    print(f"  step {len(losses)}: loss {losses[-1]:.6f}, "
          f"{seconds[-1]:.1f} s, RSS now {_now_rss_gib():.2f} GiB, peak "
          f"{_rss_gib():.2f} GiB", flush=True)
  return losses, seconds, init_s, engine.layout.update.host


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--nvme-path", required=True)
  ap.add_argument("--params-b", type=float, default=2.2)
  ap.add_argument("--twin-params-b", type=float, default=0.02)
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--batch", type=int, default=2)
  ap.add_argument("--seq", type=int, default=32)
  ap.add_argument("--devices", type=int, default=1)
  ap.add_argument("--slice-mib", type=int, default=128)
  ap.add_argument("--keep-licm", action="store_true",
                  help="leave XLA:CPU's loop-invariant code motion on")
  ap.add_argument("--buffers", type=int, default=4)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  if not args.keep_licm:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") +
        " --xla_disable_hlo_passes=while-loop-invariant-code-motion")
  import zero_jax as zj
  zj.simulate_cpu_devices(args.devices)
  from zero_jax import analysis

  batches = _batches(args.steps, args.batch, args.seq)
  rows = []
  # The twin first (small): NVMe against the host tier, the same batches.
  graphdef, params, cfg = _model(zj, args.twin_params_b, args.seq)
  twin = {}
  for where in ("host", "nvme"):
    engine = _engine(zj, graphdef, where, os.path.join(args.nvme_path, "twin"),
                     args)
    twin[where] = _train(zj, engine, params, batches)[0]
  n_twin = analysis.param_count(params)
  del params, engine
  shutil.rmtree(os.path.join(args.nvme_path, "twin"), ignore_errors=True)
  same = twin["host"] == twin["nvme"]
  print(f"twin ({n_twin / 1e6:.1f}M parameters): host tier {twin['host']}, "
        f"NVMe tier {twin['nvme']}: {'equal' if same else 'DIFFERENT'}")

  base = _rss_gib()
  graphdef, params, cfg = _model(zj, args.params_b, args.seq)
  n = analysis.param_count(params)
  print(f"  the model made: RSS now {_now_rss_gib():.2f} GiB, peak "
        f"{_rss_gib():.2f} GiB", flush=True)
  state_gb = 12 * n / 1e9
  print(f"model: d_model {cfg.d_model}, {cfg.n_layers} layers, "
        f"{n / 1e9:.3f}B parameters; fp32 master and AdamW state "
        f"{state_gb:.1f} GB ({12 * n / 2**30:.1f} GiB); RAM "
        f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.1f}"
        " GiB", flush=True)
  engine = _engine(zj, graphdef, "nvme", args.nvme_path, args)
  losses, seconds, init_s, tier = _train(zj, engine, params, batches,
                                         drop_params=True)
  del params
  peak = _rss_gib()
  io = tier.io
  read = io["read"] / io["seconds"] / 1e9
  written = io["written"] / io["seconds"] / 1e9
  line = engine.describe().split("\n")
  print("\n".join(x for x in line if "NVMe" in x))
  rows = [
      ("parameters", f"{n / 1e9:.3f}B (d_model {cfg.d_model}, "
                     f"{cfg.n_layers} layers)"),
      ("fp32 master + AdamW state", f"{state_gb:.1f} GB "
                                    f"({12 * n / 2**30:.1f} GiB), on disk "
                                    "twice (two versions)"),
      ("machine RAM", f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.1f} GiB"),
      ("peak RSS", f"{peak:.2f} GiB ({peak * 2**30 / (12 * n):.2f} of the "
                   f"state; {base:.2f} GiB before the model)"),
      ("init (write the state)", f"{init_s:.1f} s"),
      ("steps", ", ".join(f"{s:.1f} s" for s in seconds)),
      ("losses", ", ".join(f"{x:.6f}" for x in losses)),
      ("last update's pass", f"{io['read'] / 1e9:.1f} GB read, "
                             f"{io['written'] / 1e9:.1f} GB written in "
                             f"{io['seconds']:.1f} s: {read:.2f} GB/s read, "
                             f"{written:.2f} GB/s written"),
      ("twin", f"{n_twin / 1e6:.1f}M parameters: losses "
               f"{'equal' if same else 'DIFFERENT'} on the host and NVMe "
               "tiers"),
  ]
  table = "| | |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)
  print(table)
  if args.out:
    cmd = "PYTHONPATH=. python experiments/nvme_over_ram.py " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:])
        if not a.startswith("--out") and a != args.out)
    with open(args.out, "w") as f:
      f.write("# The NVMe tier: a model larger than RAM, on CPU\n\n"
              f"`{cmd}` (CPU devices: {args.devices}; batch {args.batch} x "
              f"{args.seq} tokens; XLA:CPU's loop-invariant code motion "
              f"{'on' if args.keep_licm else 'off'}: see the script's "
              "docstring)\n\n" + table + "\n")
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(main())
