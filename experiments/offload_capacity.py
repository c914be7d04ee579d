"""How large a GPT fits on one GPU with each offload option: a capacity
ladder of steps compiled for the GPU (``zero_jax.analysis``; no GPU needed).

For each GPT of the ladder (vocabulary 50304, sequence 1024, bf16 compute,
fp32 AdamW, stage 3, ``--remat`` (full; ``auto`` picks within
``--limit``), ``--batch`` sequences) the train step and the init are
compiled for one GPU with no offload, ``offload_optimizer``, both
offloads, and optimizer offload and both with the update on the host (the
fused host optimizer). The table gives the device peak of the step
(argument + output + temp - alias), the init's, and the host memory
(pinned: master, moments and, with offload, the gradients; with the update
on the host also the host buffers of the fused optimizer: master, moments,
the compute copy and the gradients); a model fits the GPU when both peaks
are under ``--limit`` GiB, and the host when its host memory is under
``--host-limit``::

  PYTHONPATH=. python experiments/offload_capacity.py
  PYTHONPATH=. python experiments/offload_capacity.py --sizes 6.7B,13B \\
      --remat auto --out experiments/results/offload_capacity_auto_h100.md
  PYTHONPATH=. python experiments/offload_capacity.py --target h200 \\
      --limit 135 --out capacity.md
"""

import argparse
import os
import sys
import time

import jax

from zero_jax import analysis
from zero_jax.models import compile_gpt, gpt_shapes

GIB = 2 ** 30
# (name, layers, hidden, heads): GPT-3's sizes to 13B (arXiv:2005.14165,
# table 2.1), then wider and deeper ones between 13B and 175B.
LADDER = [("1.3B", 24, 2048, 16), ("2.7B", 32, 2560, 32),
          ("6.7B", 32, 4096, 32), ("13B", 40, 5120, 40),
          ("20B", 44, 6144, 48), ("30B", 48, 7168, 56),
          ("65B", 80, 8192, 64)]
MODES = [("no offload", {}),
         ("offload_optimizer", dict(offload_optimizer=True)),
         ("both offloads", dict(offload_optimizer=True,
                                offload_params=True)),
         # ZeRO-Offload's split with the fused host optimizer: its host RAM
         # is the host buffers it holds plus the step's pinned memory.
         ("offload_optimizer, update on host", dict(
             offload_optimizer=True, update_on="host",
             optimizer="fused_adamw")),
         ("both, update on host", dict(offload_optimizer=True,
                                       offload_params=True, update_on="host",
                                       optimizer="fused_adamw"))]


def init_peak(engine, params_shapes) -> float:
  """Device peak of the engine's init, compiled (GiB)."""
  with jax.set_mesh(engine.mesh):
    ma = engine.lower_init(params_shapes).compile().memory_analysis()
  return (ma.argument_size_in_bytes + ma.output_size_in_bytes +
          ma.temp_size_in_bytes - ma.alias_size_in_bytes) / GIB


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--target", default="h100", choices=sorted(analysis.TARGETS))
  p.add_argument("--limit", type=float, default=76.0,
                 help="GiB a step and init may use (default 76, an H100's "
                 "80 GiB less what CUDA and XLA keep)")
  p.add_argument("--host-limit", type=float, default=120.0,
                 help="GiB of pinned host memory one GPU may use (default "
                 "120: a 128 GiB host with one GPU)")
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--remat", default="full",
                 help="ZeroConfig.remat of every step (default full)")
  p.add_argument("--sizes", default=",".join(n for n, *_ in LADDER))
  p.add_argument("--out", default=os.path.join(
      os.path.dirname(__file__), "results", "offload_capacity_{target}.md"))
  args = p.parse_args(argv)
  sizes = args.sizes.split(",")
  rows, largest = [], {}
  for name, layers, hidden, heads in LADDER:
    if name not in sizes:
      continue
    for mode, kw in MODES:
      t = time.time()
      engine, c = compile_gpt(args.target, 1, 3, layers=layers,
                              hidden=hidden, heads=heads, vocab=50304,
                              seq_len=1024, micro_batch=args.batch,
                              remat=args.remat, overrides={
                                  # (remat="auto" picks within the limit)
                                  "device_memory_bytes": int(
                                      args.limit * GIB)}, **kw)
      _, shapes = gpt_shapes(layers=layers, hidden=hidden, heads=heads,
                              vocab=50304, seq_len=1024)
      step = c.memory.peak / GIB
      host = c.memory.host / GIB
      if kw.get("update_on") == "host":
        # (Its init is the compute copy sent to the device, which the
        # step's arguments hold.)
        init = 0.0
        host += engine.layout.update.host_bytes(engine.layout) / GIB
      else:
        init = init_peak(engine, shapes)
      fits = max(step, init) <= args.limit
      with_host = fits and host <= args.host_limit
      for key, ok in ((mode, fits), ((mode, "host"), with_host)):
        if ok:
          largest[key] = (name, c.params)
      rows.append((name, c.params, mode, engine.remat.value, step, init,
                   host, fits, with_host))
      print(f"{name:>5} {mode:<18} step {step:7.2f} GiB  init {init:7.2f} "
            f"GiB  host {host:7.2f} GiB  "
            f"{'fits' if fits else 'does not fit'}  ({time.time() - t:.0f} s)",
            flush=True)
  lines = [f"Capacity on one {args.target} (compiled, limit {args.limit:g} "
           f"GiB): GPT, vocabulary 50304, sequence 1024, batch "
           f"{args.batch}, bf16, fp32 AdamW, stage 3, remat {args.remat}.",
           "",
           "| GPT | params | offload | remat | step peak GiB | init peak "
           f"GiB | host GiB | fits the GPU | and host <= {args.host_limit:g} "
           "GiB |", "|---|---|---|---|---|---|---|---|---|"]
  yes = lambda ok: "yes" if ok else "no"
  for name, n, mode, remat, step, init, host, fits, with_host in rows:
    lines.append(f"| {name} | {n / 1e9:.2f}B | {mode} | {remat} | "
                 f"{step:.2f} | "
                 f"{init:.2f} | {host:.2f} | {yes(fits)} | "
                 f"{yes(with_host)} |")
  lines.append("")
  for mode, _ in MODES:
    name, n = largest.get(mode, ("none", 0))
    hname, hn = largest.get((mode, "host"), ("none", 0))
    lines.append(f"- largest with {mode}: {name} ({n / 1e9:.2f}B "
                 f"parameters); with at most {args.host_limit:g} GiB of host "
                 f"memory: {hname} ({hn / 1e9:.2f}B)")
  text = "\n".join(lines) + "\n"
  print(text)
  out = args.out.format(target=args.target)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w") as f:
    f.write(text)
  print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
  main()
