"""zero_jax's stage-3 step beside a GSPMD FSDP step, compiled for H100s.

Compiles (never runs) one train step of the reference GPT (vocabulary
50304, sequence 1024, cuDNN attention where it applies: ``GPTConfig.
attention="auto"``, bf16 compute, fp32 master weights and fp32 AdamW,
remat ``"full"``) for N compile-only H100s (``zero_jax.analysis.gpu_mesh``,
no GPU needed), two ways:

- zero_jax stage 3 (``models.compile_gpt``), once per entry of
  ``CONFIGS`` (name -> ``ZeroConfig`` overrides), and stage 2 beside it,
  with its replicated bf16 copy and gathering in forward (prefetch);
- the MaxText-style GSPMD FSDP peer (``models.compile_gspmd_gpt``): one
  plain ``jax.jit`` of the same loss, gradient and optax update, with the
  same stage-3 layout of parameters and optimizer state and the
  activations pinned to the batch sharding; every collective is XLA's.

For each it reports the compiled per-device peak and temporaries
(``memory_analysis()``), the persistent state (fp32 master + AdamW
moments) per device, the collectives per device and step by kind and dtype
(loops counted by trip count, ``CompiledStep.collectives``), and how
many of the asynchronous parameter all-gathers and gradient sums
(reduce-scatters; zero_jax's all-to-alls) and the rest have at least one
gemm scheduled between their start and done
(``analysis.overlap_summary``; the rule is
``analysis.overlap``'s). Each compile runs in a subprocess (its host
memory is returned, a failure costs one row); the report is rewritten
after every row::

  PYTHONPATH=. python experiments/stage3_bench.py --devices 8,64,256 \\
      --sizes 1.3b,6.7b
  PYTHONPATH=. python experiments/stage3_bench.py --quick --out-dir s3_quick

``--quick`` compiles a 4-layer GPT of width 128 on 8 GPUs (the test's
shapes, einsum attention), zero_jax's default config and GSPMD only.
``--xla-flags`` adds XLA flags to every compile (e.g. the collective
pipeliner's), to measure what they change::

  PYTHONPATH=. python experiments/stage3_bench.py --sizes 1.3b \\
      --configs default,gspmd --out-dir s3_pipelined \\
      --xla-flags="--xla_gpu_enable_pipelined_all_gather=true"
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shlex
import subprocess
import sys
import time

GIB = 2 ** 30
# name: GPT shape and micro-batch (sequences per device and step).
SIZES = {
    "1.3b": dict(hidden=2048, layers=24, heads=16, micro_batch=8),
    "6.7b": dict(hidden=4096, layers=32, heads=32, micro_batch=4),
}
VOCAB, SEQ_LEN, ATTENTION = 50304, 1024, "auto"
# --quick: the tests' tiny GPT. Its attention is the einsum: at these
# shapes GSPMD splits the heads over ``data`` and cuDNN attention's
# partitioner refuses 4 heads over 8 devices.
QUICK_SIZES = {
    "tiny": dict(hidden=128, layers=4, heads=4, micro_batch=2, vocab=64,
                 seq_len=16, attention="einsum"),
    # (Only when named: the GPT tests/train/test_loss_scope.py compiles.)
    "small": dict(hidden=256, layers=4, heads=4, micro_batch=2, vocab=4096,
                  seq_len=256),
}
# zero_jax configurations (stage 3 unless "stage" says otherwise): name ->
# ZeroConfig overrides.
CONFIGS = {
    # The default: a loss of one device's meaning (``loss_scope="global"``),
    # its collectives the compiler's on the ZeRO layout, each scanned layer
    # gathered one layer ahead by sharding constraints (prefetch "auto"),
    # its gradients summed in the compute dtype (bf16).
    "default": {},
    # Each layer gathered at the top of its own iteration.
    "no prefetch": {"prefetch": False},
    # The per-device loss (DeepSpeed's meaning), with its own collectives:
    # bf16 gradients summed in fp32 by an all-to-all, or in bf16.
    "per device": {"loss_scope": "per_device"},
    "per device reduce bf16": {"loss_scope": "per_device",
                               "reduce_dtype": "bfloat16"},
    # ZeRO++'s quantized collectives (approximate); qgZ needs the
    # per-device loss, which quantizes each device's own gradient.
    "qwZ": {"quantized_weights": True},
    "qwZ per device": {"quantized_weights": True,
                       "reduce_dtype": "bfloat16",
                       "loss_scope": "per_device"},
    "qwZ + qgZ per device": {"quantized_weights": True,
                             "quantized_gradients": True,
                             "loss_scope": "per_device"},
    # ZeRO++'s hpZ over nodes of GPUS_PER_NODE (N > GPUS_PER_NODE only).
    "hpz": {"hpz_partition_size": 8},
    "hpz per device": {"hpz_partition_size": 8, "reduce_dtype": "bfloat16",
                       "loss_scope": "per_device"},
    # Stage 2: the replicated bf16 copy, its gradients reduce-scattered a
    # layer at a time; per device, also without a copy, gathering the
    # master's shards in bf16 one layer ahead in forward (FSDP's
    # SHARD_GRAD_OP).
    "stage 2": {"stage": 2},
    "stage 2 per device (no prefetch)": {"stage": 2, "prefetch": False,
                                         "loss_scope": "per_device"},
    "stage 2 per device": {"stage": 2, "loss_scope": "per_device"},
    # The fp32 master in host memory, each scanned layer's shards copied
    # to the device inside the layer loop.
    "offload params": {"offload_params": "host"},
    "offload params per device": {"offload_params": "host",
                                  "reduce_dtype": "bfloat16",
                                  "loss_scope": "per_device"},
}
GPUS_PER_NODE = 8
GSPMD = "gspmd"
LABELS = {GSPMD: "GSPMD FSDP"}
# The collectives the two overlap columns count.
GATHER, REDUCE = "all-gather", "reduce-scatter"


def label(run: str) -> str:
  if "stage" in CONFIGS.get(run, {}):
    return f"zero_jax {run}"
  return LABELS.get(run, f"zero_jax stage 3 ({run})")


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--devices", default=None,
                 help="comma-separated device counts N (default 8,64,256; "
                 "8 with --quick)")
  p.add_argument("--sizes", default=None,
                 help=f"comma-separated sizes of {', '.join(SIZES)}")
  p.add_argument("--configs", default=None,
                 help="comma-separated runs: names of CONFIGS and "
                 f"'{GSPMD}' (default all; with --quick: default,{GSPMD})")
  p.add_argument("--target", default="h100")
  p.add_argument("--quick", action="store_true",
                 help="the tests' tiny GPT on 8 GPUs")
  p.add_argument("--xla-flags", default="",
                 help="extra XLA_FLAGS for every compile, written with "
                 "'=': --xla-flags='--xla_gpu_enable_pipelined_all_gather"
                 "=true'")
  p.add_argument("--out-dir", default=os.path.join("experiments", "results"))
  p.add_argument("--name", default=None,
                 help="report file name without extension (default "
                 "stage3_<target>)")
  p.add_argument("--hlo-dir", default=None,
                 help="write each compiled step's HLO text here")
  p.add_argument("--timeout", type=float, default=1200,
                 help="seconds per compile")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  return p.parse_args(argv)


# ------------------------------------------------------------------ worker


def measure(spec: dict) -> dict:
  """Compiles one run (in this process) and measures it."""
  # pylint: disable=g-import-not-at-top
  import jax
  from zero_jax import analysis, models
  # pylint: enable=g-import-not-at-top
  shape = {k: spec[k] for k in ("layers", "hidden", "heads", "vocab",
                                "seq_len", "micro_batch", "attention")}
  t0 = time.perf_counter()
  if spec["run"] == GSPMD:
    state, c = models.compile_gspmd_gpt(spec["target"], spec["n"],
                                        remat="full", **shape)
    state_bytes = analysis.per_device_bytes(state)
  else:
    overrides = CONFIGS[spec["run"]]
    k = overrides.get("hpz_partition_size", 1)
    engine, c = models.compile_gpt(spec["target"], spec["n"], 3,
                                   remat="full", overrides=overrides,
                                   # hpZ: one group per node.
                                   replica=spec["n"] // k if k > 1 else 1,
                                   **shape)
    _, params = models.gpt_shapes(
        **{k: shape[k] for k in ("layers", "hidden", "heads", "vocab",
                                 "seq_len")})
    fields = analysis.train_state_bytes(engine.abstract_state(params))
    state_bytes = fields["params"] + fields["opt_state"]
  compile_s = time.perf_counter() - t0
  if spec.get("hlo_dir"):
    os.makedirs(spec["hlo_dir"], exist_ok=True)
    name = f"{spec['size']}_n{spec['n']}_{spec['run'].replace(' ', '_')}"
    with open(os.path.join(spec["hlo_dir"], name + ".hlo"), "w",
              encoding="utf-8") as f:
      f.write(c.hlo)
  mem = c.memory
  return {
      "status": "ok", "psi": c.params, "compile_s": compile_s,
      "peak_bytes": mem.peak, "temp_bytes": mem.temp,
      "argument_bytes": mem.argument, "output_bytes": mem.output,
      "alias_bytes": mem.alias, "state_bytes": state_bytes,
      "cross_node_bytes": analysis.sent_across_nodes(c.hlo,
                                                    GPUS_PER_NODE),
      "collectives": [{"kind": k, "dtype": dt, **d} for (k, dt), d in
                      sorted(c.collectives.items())],
      # Per kind, a combined collective of several dtypes once.
      "counts": {k: v["count"] for k, v in
                 sorted(analysis.summarize(c.hlo).items())},
      "overlap": {k: {"overlapped": v.overlapped, "total": v.total,
                      "bytes": v.bytes,
                      "overlapped_bytes": v.overlapped_bytes}
                  for k, v in sorted(
                      analysis.overlap_summary(c.hlo).items())},
      # (Linux reports kilobytes.)
      "host_rss_bytes": resource.getrusage(
          resource.RUSAGE_SELF).ru_maxrss * 1024,
      "jax": jax.__version__,
  }


# ------------------------------------------------------------------ parent


def in_subprocess(spec: dict, args: argparse.Namespace) -> dict:
  env = dict(os.environ)
  # Compile-only GPUs need no GPU; a real one here is left alone.
  env.setdefault("JAX_PLATFORMS", "cpu")
  if args.xla_flags:
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
  cmd = [sys.executable, os.path.abspath(__file__), "--worker",
         json.dumps(spec)]
  t0 = time.perf_counter()
  try:
    out = subprocess.run(cmd, capture_output=True, text=True,
                         timeout=args.timeout, env=env)
  except subprocess.TimeoutExpired:
    return {"status": f"did not compile within {args.timeout:.0f} s"}
  for line in out.stdout.splitlines():
    if line.startswith("RESULT "):
      return {**json.loads(line[7:]), "wall_s": time.perf_counter() - t0}
  text = (out.stdout + out.stderr).strip()
  errors = [x for x in text.splitlines() if "Error" in x]
  last = (errors or text.splitlines() or [f"exit {out.returncode}"])[-1]
  return {"status": f"error: {last[:300]}", "error": text[-4000:]}


def plan(args: argparse.Namespace) -> list[dict]:
  """The runs: per size, per N, every config then GSPMD."""
  sizes = QUICK_SIZES if args.quick else SIZES
  names = (args.sizes.split(",") if args.sizes else
           ["tiny"] if args.quick else list(sizes))
  ns = [int(n) for n in (args.devices or ("8" if args.quick else
                                          "8,64,256")).split(",")]
  runs = (args.configs.split(",") if args.configs else
          ["default", GSPMD] if args.quick else [*CONFIGS, GSPMD])
  for bad in [x for x in names if x not in sizes]:
    raise SystemExit(f"--sizes: unknown size {bad!r}; known: "
                     f"{', '.join(sizes)}")
  for bad in [x for x in runs if x not in CONFIGS and x != GSPMD]:
    raise SystemExit(f"--configs: unknown run {bad!r}; known: "
                     f"{', '.join([*CONFIGS, GSPMD])}")
  out = []
  for size in names:
    shape = {"vocab": VOCAB, "seq_len": SEQ_LEN, "attention": ATTENTION,
             **sizes[size]}
    for n in ns:
      for run in runs:
        if (run != GSPMD and n <= GPUS_PER_NODE and
            CONFIGS[run].get("hpz_partition_size", 1) > 1):
          continue  # (one node: nothing for hpZ to keep inside)
        out.append(dict(size=size, n=n, run=run, target=args.target,
                        hlo_dir=args.hlo_dir, **shape))
  return out


# ------------------------------------------------------------------ report


def gib(b: float) -> str:
  return f"{b / GIB:.2f}"


def reductions(r: dict) -> tuple[str, ...]:
  """The kinds that sum gradients: zero_jax sends 16-bit gradients summed
  in fp32 (and qgZ's int8 blocks) by all-to-alls; GSPMD's all-to-alls
  move activations."""
  return (REDUCE,) if r["run"] == GSPMD else (REDUCE, "all-to-all")


def ratio(r: dict, *kinds: str) -> str:
  """Overlapped/total executions, and the overlapped share of the bytes."""
  os_ = [r["overlap"][k] for k in kinds if k in r["overlap"]]
  if not os_:
    return "-"
  total = sum(o["bytes"] for o in os_)
  share = sum(o["overlapped_bytes"] for o in os_) / total if total else 0.0
  return (f"{sum(o['overlapped'] for o in os_)}/"
          f"{sum(o['total'] for o in os_)} ({share:.0%} of bytes)")


def others(r: dict) -> str:
  return ", ".join(f"{k} {v['overlapped']}/{v['total']}"
                   for k, v in r["overlap"].items()
                   if k not in (GATHER, *reductions(r))) or "-"


MEMORY_COLUMNS = ("size", "N", "run", "peak GiB", "peak / GSPMD",
                  "temp GiB", "state GiB", "across nodes GiB",
                  "AG overlapping a gemm",
                  "gradient sums overlapping a gemm",
                  "other async overlapping",
                  "compile s", "host RSS GiB")
COMM_COLUMNS = ("size", "N", "run", "kind", "dtype", "count", "GiB")


def memory_rows(rows: list[dict]) -> list[list[str]]:
  peers = {(r["size"], r["n"]): r for r in rows
           if r["run"] == GSPMD and r["status"] == "ok"}
  out = []
  for r in rows:
    head = [r["size"], str(r["n"]), label(r["run"])]
    if r["status"] != "ok":
      out.append(head + [r["status"]] + [""] * (len(MEMORY_COLUMNS) - 4))
      continue
    peer = peers.get((r["size"], r["n"]))
    vs = f"{r['peak_bytes'] / peer['peak_bytes']:.3f}" if peer else "-"
    out.append(head + [gib(r["peak_bytes"]), vs, gib(r["temp_bytes"]),
                       gib(r["state_bytes"]),
                       (gib(r["cross_node_bytes"]) if "cross_node_bytes" in r
                        else "-"), ratio(r, GATHER),
                       ratio(r, *reductions(r)), others(r),
                       f"{r['compile_s']:.0f}",
                       gib(r["host_rss_bytes"])])
  return out


def comm_rows(rows: list[dict]) -> list[list[str]]:
  return [[r["size"], str(r["n"]), label(r["run"]), c["kind"], c["dtype"],
           str(c["count"]), f"{c['bytes'] / GIB:.3f}"]
          for r in rows if r["status"] == "ok" for c in r["collectives"]]


def markdown_table(columns, cells) -> str:
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])


def text_table(columns, cells) -> str:
  widths = [max([len(c)] + [len(r[i]) for r in cells])
            for i, c in enumerate(columns)]
  fmt = lambda r: " | ".join(c.rjust(w) for c, w in zip(r, widths))
  return "\n".join([fmt(columns), "-+-".join("-" * w for w in widths)] +
                   [fmt(r) for r in cells])


def revision() -> str:
  """The commit of the zero_jax measured (``-dirty`` with the package's
  uncommitted changes, named), or ``"?"`` outside a git checkout."""
  spec = importlib.util.find_spec("zero_jax")
  root = os.path.dirname(os.path.dirname(os.path.abspath(spec.origin)))
  git = lambda *a: subprocess.run(["git", "-C", root, *a],
                                  capture_output=True, text=True,
                                  check=True).stdout
  try:
    changed = [line[3:] for line in git("status", "--porcelain", "--",
                                        "zero_jax").splitlines()]
    described = git("describe", "--always", "--dirty").strip()
  except (OSError, subprocess.CalledProcessError):
    return "?"
  return described + (f" (uncommitted: {', '.join(changed)})"
                      if changed else "")


def report(rows: list[dict], args: argparse.Namespace, command: str) -> str:
  ok = [r for r in rows if r["status"] == "ok"]
  jax_version = ok[0]["jax"] if ok else "?"
  flags = f" with `XLA_FLAGS={args.xla_flags}`" if args.xla_flags else ""
  return "\n".join([
      f"# zero_jax stage 3 vs GSPMD FSDP on {args.target.upper()}s "
      "(compiled, not run)", "", f"`{command}`", "",
      f"- Each step is compiled for N compile-only {args.target.upper()}s "
      f"(`zero_jax.analysis.gpu_mesh`), jax {jax_version}{flags}, code "
      f"{revision()}, never "
      "run: memory from `compiled.memory_analysis()` (peak = argument + "
      "output + temp - alias), collectives from its HLO.",
      f"- GPT of vocabulary {VOCAB}, sequence {SEQ_LEN}, attention "
      f"`{ATTENTION}` (cuDNN's), bf16 compute, fp32 master and AdamW, "
      "remat `full`; 1.3b: 24 layers, d 2048, 16 heads, micro-batch 8; "
      "6.7b: 32 layers, d 4096, 32 heads, micro-batch 4 (sequences per "
      "device).",
      "- zero_jax: `models.compile_gpt(stage=3)` with the config's "
      "ZeroConfig overrides (`stage=2` where the config says so); GSPMD "
      "FSDP: `models.compile_gspmd_gpt`, one "
      "`jax.jit` of the same loss and update, params and AdamW state laid "
      "out by the same stage-3 plan, activations pinned to the batch "
      "sharding at every block boundary and on the logits.",
      "- state = fp32 master + AdamW moments per device. Overlap: of the "
      "asynchronous collectives' executions per step (loop bodies by trip "
      "count), those with at least one gemm (cuBLAS/cuDNN call, gemm "
      "fusion, or a loop running one) scheduled between start and done "
      "(`zero_jax.analysis.overlap`). AG = all-gather; gradient sums: "
      "reduce-scatters, and zero_jax's all-to-alls (16-bit gradients "
      "summed in fp32 on the shard, qgZ's int8 blocks); in parentheses "
      "the overlapped ones' share of the bytes. Across nodes: the bytes "
      "each device sends per step in collectives whose groups span nodes "
      f"of {GPUS_PER_NODE} GPUs (ring estimates from each result's bytes B"
      " in groups of g: all-gather and all-to-all B(g-1)/g, reduce-scatter"
      " B(g-1), all-reduce 2B(g-1)/g). hpz: `make_mesh(replica=N // 8)` with "
      "`hpz_partition_size=8` (N > 8 only).", "",
      "## Memory and overlap", "",
      markdown_table(MEMORY_COLUMNS, memory_rows(rows)), "",
      "## Collectives per device and step", "",
      markdown_table(COMM_COLUMNS, comm_rows(rows)), ""])


def write(rows: list[dict], args: argparse.Namespace, command: str) -> None:
  os.makedirs(args.out_dir, exist_ok=True)
  name = args.name or f"stage3_{args.target}"
  with open(os.path.join(args.out_dir, name + ".md"), "w",
            encoding="utf-8") as f:
    f.write(report(rows, args, command))
  with open(os.path.join(args.out_dir, name + ".json"), "w",
            encoding="utf-8") as f:
    json.dump({"command": command, "xla_flags": args.xla_flags,
               "rows": rows}, f, indent=1)


def main() -> None:
  args = parse_args()
  if args.worker:
    print("RESULT " + json.dumps(measure(json.loads(args.worker))),
          flush=True)
    return
  command = " ".join(["PYTHONPATH=. python", "experiments/stage3_bench.py"] +
                     [shlex.quote(a) for a in sys.argv[1:]])
  specs = plan(args)
  rows = []
  t_start = time.perf_counter()
  for i, spec in enumerate(specs, 1):
    what = f"[{i}/{len(specs)}] {spec['size']} N={spec['n']} " \
           f"{label(spec['run'])}"
    print(f"{what}: compiling", file=sys.stderr, flush=True)
    r = {**{k: spec[k] for k in ("size", "n", "run")},
         **in_subprocess(spec, args)}
    rows.append(r)
    done = (f"peak {gib(r['peak_bytes'])} GiB, temp {gib(r['temp_bytes'])} "
            f"GiB, AG {ratio(r, GATHER)} and gradient sums "
            f"{ratio(r, *reductions(r))} "
            f"overlapping a gemm, compiled in {r['compile_s']:.0f} s "
            f"(host {gib(r['host_rss_bytes'])} GiB)"
            if r["status"] == "ok" else r["status"])
    print(f"{what}: {done} (elapsed {time.perf_counter() - t_start:.0f} s)",
          file=sys.stderr, flush=True)
    write(rows, args, command)
  print(text_table(MEMORY_COLUMNS, memory_rows(rows)))
  print()
  print(text_table(COMM_COLUMNS, comm_rows(rows)))
  name = args.name or f"stage3_{args.target}"
  print(f"\nwrote {os.path.join(args.out_dir, name)}.md and .json")


if __name__ == "__main__":
  main()
