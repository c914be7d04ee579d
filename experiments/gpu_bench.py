"""Every GPU measurement of zero_jax, in one call.

On one accelerator, for the reference GPT (vocabulary 50304, sequence 1024,
bf16 compute, fp32 master weights and AdamW state, ZeRO stage 3) at the
settings a user gets by default on a GPU: cuDNN flash attention
(``GPTConfig.attention="auto"``), the chunked loss (``loss_chunk``) and
``ZeroConfig(remat="auto")``, the fastest remat whose compiled step fits:

- speed (``--plan speed``, the default): step time, tokens/s, MFU
  ((6·Ψ + 12·L·T·d) x tokens/s over the device's bf16 peak), the compiled
  and the measured peak memory and the chosen remat, for
  - zero_jax stage 3;
  - plain ``jax.jit`` + optax at the same settings (the same attention,
    loss chunk and the remat zero_jax chose; ``GPTConfig.remat``);
  - the torch peers (``torch_bench.py``, a subprocess: torch is
    benchmark-only): ``torch.compile`` without and with per-block
    checkpointing, and FSDP2's ``fully_shard``;
- offload (``--plan offload``): zero_jax with ``offload_optimizer="host"``
  (streamed through the device; with ``offload_params``; the update on the
  host's CPU devices; the same delayed one step);
- capacity (``--plan capacity``): the largest model of the size ladder that
  trains, with and without optimizer offload.

Each run is a subprocess (an out-of-memory run fails alone, and the device's
peak memory counter starts from zero). JAX's runs may use 95% of the device
(``XLA_PYTHON_CLIENT_MEM_FRACTION``, unless set), as torch may. Results are
written after every run to ``gpu_bench.json`` and ``gpu_bench.md`` in
``--out-dir``; runs that would start after ``--budget`` seconds are skipped::

  PYTHONPATH=. python experiments/gpu_bench.py                  # speed
  PYTHONPATH=. python experiments/gpu_bench.py --plan all       # everything
  PYTHONPATH=. python experiments/gpu_bench.py --dry-run        # list the runs
  python experiments/gpu_bench.py --tiny --out-dir bench        # CPU check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

# name: (d_model, n_layers, n_heads); vocabulary 50304, sequence 1024.
SIZES = {
    "125m": (768, 12, 12),
    "350m": (1024, 24, 16),
    "760m": (1536, 24, 16),
    "1.3b": (2048, 24, 16),
    "2.7b": (2560, 32, 32),
    "6.7b": (4096, 32, 32),
    "13b": (5120, 40, 40),
    "20b": (6144, 44, 48),
    "30b": (7168, 48, 56),
}
TINY_SIZES = {"tiny": (64, 2, 4), "tiny2": (128, 2, 4)}
ZERO = "zero_jax stage 3"
BASELINE = "baseline (jax.jit + optax)"
MODES = {
    # name: ZeroConfig overrides (None: plain jax.jit + optax)
    ZERO: {},
    BASELINE: None,
    # Each scanned layer gathered one layer ahead, asked for: on one GPU
    # "auto" leaves it off (nothing to gather), so this measures the
    # prefetched scan's own cost; remat full only.
    "zero_jax stage 3 + prefetch": {"prefetch": True, "remat": "full"},
    # The update streamed through the device a slice at a time.
    "zero_jax stage 3 + offload": {"offload_optimizer": "host"},
    "zero_jax stage 3 + offload + offload_params": {
        "offload_optimizer": "host", "offload_params": "host"},
    # ZeRO-Offload's split: the update is the host's own program.
    "zero_jax stage 3 + offload, update on host": {
        "offload_optimizer": "host", "update_on": "host"},
    # ... overlapped with the next step (one update late: other math).
    "zero_jax stage 3 + offload, update on host, delayed": {
        "offload_optimizer": "host", "update_on": "host",
        "delay_update": True},
}
# The torch peers: torch_bench.py's flags.
TORCH_MODES = {
    "torch.compile": ["--checkpoint", "none"],
    "torch.compile, per-block checkpoint": ["--checkpoint", "block"],
    "torch FSDP2, per-block checkpoint, compiled": ["--checkpoint", "block",
                                                    "--fsdp"],
}
ALL_MODES = list(MODES) + list(TORCH_MODES)
SPEED_MODES = [ZERO, BASELINE, *TORCH_MODES]
# Speed modes run only when --modes names them.
OPT_IN_SPEED_MODES = ["zero_jax stage 3 + prefetch"]
_OFFLOADS = [m for m in MODES if m.startswith(ZERO + " + offload")]
_LADDER_MODES = (ZERO, "zero_jax stage 3 + offload",
                 "zero_jax stage 3 + offload + offload_params")
_TORCH_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                             "torch_bench.py")


@dataclasses.dataclass
class Run:
  """One measurement: a model size trained in one mode.

  ``remat`` is a ``ZeroConfig.remat`` name; the baseline's ``"auto"``
  becomes what zero_jax chose for the same size just before it (``"full"``
  if zero_jax did not train; the table shows which).
  """

  size: str
  mode: str
  batch: int
  seq_len: int
  steps: int
  tiny: bool = False
  attention: str = "auto"
  remat: str = "auto"
  loss_chunk: int | None = 1024


# ------------------------------------------------------------------ worker


def _params_host(abstract, seed: int = 0):
  """Host (numpy) parameters of the given shapes, cheaply: a block of
  normal samples tiled over each leaf (timing does not depend on values)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  block = (0.02 * rng.standard_normal(1 << 22)).astype(np.float32)

  def make(x):
    if len(x.shape) == 1:  # LayerNorm scales and biases
      return np.ones(x.shape, np.float32) if x.shape else np.float32(1)
    return np.resize(block, x.shape)

  return jax.tree.map(make, abstract)


def run_one(run: Run) -> dict:
  """Trains ``run.steps`` steps of a JAX mode; returns the measurements."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  import zero_jax as zj  # pylint: disable=g-import-not-at-top
  from zero_jax import metrics as zm  # pylint: disable=g-import-not-at-top
  from zero_jax.analysis import compiled_memory, param_count  # pylint: disable=g-import-not-at-top
  from zero_jax.models import GPT, GPTConfig, make_loss_fn  # pylint: disable=g-import-not-at-top

  overrides = MODES[run.mode]
  if not run.tiny and (overrides or {}).get("update_on") == "host":
    # One CPU device per core for the host's update (before JAX starts;
    # each run is a fresh process).
    jax.config.update("jax_num_cpu_devices", os.cpu_count())
  d, layers, heads = (TINY_SIZES if run.tiny else SIZES)[run.size]
  cfg = GPTConfig(vocab_size=256 if run.tiny else 50304, seq_len=run.seq_len,
                  d_model=d, n_layers=layers, n_heads=heads,
                  attention=run.attention, loss_chunk=run.loss_chunk,
                  # The baseline's layer scan at the policy given; an
                  # engine's at its ZeroConfig.remat.
                  remat=run.remat if overrides is None else None)
  graphdef, abstract = nnx.split(
      nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  psi = param_count(abstract)
  params = _params_host(abstract)
  loss_fn = make_loss_fn(graphdef)
  tx = optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.1)
  if (overrides or {}).get("update_on") == "host":
    # The same AdamW, as the fused host optimizer runs it.
    tx = zj.offload.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.1)
  device = jax.devices()[0]
  rng = np.random.default_rng(0)
  batch = {"tokens": rng.integers(0, cfg.vocab_size,
                                  (run.batch, run.seq_len + 1), np.int32)}

  t0 = time.perf_counter()
  chosen = {"remat": run.remat}
  if overrides is None:
    # The baseline: the same mixed precision, by hand, in one jit.
    bf16 = lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t)

    @jax.jit
    def init(p):
      return p, tx.init(p)

    def train_step(state, batch):
      p, o = state
      loss, g = jax.value_and_grad(lambda p: loss_fn(bf16(p), batch))(p)
      u, o = tx.update(g, o, p)
      return (optax.apply_updates(p, u), o), loss

    train_step = jax.jit(train_step, donate_argnums=0)
    state = init(jax.device_put(params, device))
    batch = jax.device_put(batch, device)
    compiled = train_step.lower(state, batch).compile()
  else:
    engine = zj.Engine(loss_fn, tx,
                       zj.ZeroConfig(**{"stage": 3,
                                        "compute_dtype": "bfloat16",
                                        "remat": run.remat, **overrides}),
                       zj.make_mesh(num_devices=1))
    state = engine.init(params)
    batch = engine.shard_batch(batch)
    compiled = engine.step.lower(state, batch).compile()
    chosen = {"remat": engine.remat, "remat_reason": engine.remat_reason}
  # With the update on the host a step is two programs (the device's,
  # compiled above, and the host's): it runs through engine.step.
  runner = (engine.step if overrides and overrides.get("update_on") == "host"
            else compiled)
  del params
  mem = compiled_memory(compiled)
  t_compile = time.perf_counter() - t0

  times, losses = [], []
  for _ in range(run.steps):
    t = time.perf_counter()
    if overrides is None:
      state, loss = runner(state, batch)
    else:
      # (The compiled step also returns float16's divergence flag.)
      state, metrics = runner(state, batch)[:2]
      loss = metrics["loss"]
    losses.append(float(jax.block_until_ready(loss)))
    times.append(time.perf_counter() - t)
  # The first step warms up (allocations, autotuning): not timed.
  step_time = float(np.median(times[1:] if len(times) > 1 else times))
  tokens = run.batch * run.seq_len
  fpt = zm.transformer_flops_per_token(psi, layers, run.seq_len, d)
  stats = device.memory_stats() or {}
  peak = zm.peak_flops(device)
  return {
      **dataclasses.asdict(run), **chosen, "status": "ok", "params": psi,
      "device": device.device_kind, "platform": device.platform,
      "jax": jax.__version__, "compile_s": t_compile,
      "step_s": step_time, "tokens_per_s": tokens / step_time,
      "mfu": zm.mfu(fpt, tokens / step_time, peak),
      "peak_flops": peak, "losses": losses,
      "compiled_device_bytes": mem.peak,
      "compiled_host_bytes": (compiled.memory_analysis()
                              .host_argument_size_in_bytes),
      "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
      "bytes_limit": stats.get("bytes_limit"),
      # Where the host update's time went (the last step's phases).
      "host_update": ([line for line in engine.describe().splitlines()
                       if "over PCIe" in line] if overrides and
                      overrides.get("update_on") == "host" else None),
  }


def _worker_main(spec: str) -> None:
  run = Run(**json.loads(spec))
  print("RESULT " + json.dumps(run_one(run)), flush=True)


# ------------------------------------------------------------------ parent


def _command(run: Run) -> list[str]:
  if run.mode in TORCH_MODES:
    return [sys.executable, _TORCH_SCRIPT, "--size", run.size, "--batch",
            str(run.batch), "--seq-len", str(run.seq_len), "--steps",
            str(run.steps), *TORCH_MODES[run.mode],
            *(["--tiny"] if run.tiny else [])]
  return [sys.executable, os.path.abspath(__file__), "--worker",
          json.dumps(dataclasses.asdict(run))]


def _in_subprocess(run: Run, timeout: float) -> dict:
  # Like torch, JAX may use (almost) the whole device.
  env = dict(os.environ)
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
  t0 = time.perf_counter()
  try:
    out = subprocess.run(_command(run), capture_output=True, text=True,
                         timeout=timeout, env=env)
  except subprocess.TimeoutExpired:
    return {**dataclasses.asdict(run), "status": "timeout",
            "wall_s": time.perf_counter() - t0}
  for line in out.stdout.splitlines():
    if line.startswith("RESULT "):
      return {**dataclasses.asdict(run), **json.loads(line[7:]),
              "wall_s": time.perf_counter() - t0}
  text = out.stdout + out.stderr
  oom = any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory",
                                "out of memory"))
  return {**dataclasses.asdict(run), "status": "oom" if oom else "error",
          "error": text[-2000:], "wall_s": time.perf_counter() - t0}


def _fmt(x, spec, scale=1.0):
  return "-" if x is None else format(x * scale, spec)


def _summary(results: list[dict]) -> list[str]:
  """The comparisons the tables hold, one line each."""
  ok = [r for r in results if r["status"] == "ok"]
  lines = []
  for size in dict.fromkeys(r["size"] for r in ok if not r.get("capacity")):
    by = {r["mode"]: r for r in ok
          if r["size"] == size and not r.get("capacity")}
    zero, base = by.get(ZERO), by.get(BASELINE)
    if zero:
      lines.append(f"- {size}: zero_jax stage 3 MFU "
                   f"{_fmt(zero['mfu'], '.1%')}; {zero.get('remat_reason')}")
    if zero and base:
      lines.append(f"- {size}: zero_jax step time / plain jax.jit at the "
                   f"same settings (remat {base['remat']}) "
                   f"{zero['step_s'] / base['step_s']:.3f}")
    for mode in TORCH_MODES:
      if zero and mode in by:
        lines.append(f"- {size}: {mode}: MFU {_fmt(by[mode]['mfu'], '.1%')}, "
                     f"zero_jax step time / its "
                     f"{zero['step_s'] / by[mode]['step_s']:.3f}")
    for mode in _OFFLOADS:
      if zero and mode in by:
        lines.append(f"- {size}: {mode}: step time / no offload "
                     f"{by[mode]['step_s'] / zero['step_s']:.3f}")
  for mode in _LADDER_MODES:
    fits = [r for r in ok if r["mode"] == mode and r.get("capacity")]
    if fits:
      best = max(fits, key=lambda r: r["params"])
      lines.append(f"- largest model that trains, {mode}: {best['size']} "
                   f"({best['params']:,.0f} parameters)")
  return lines


def write_results(results: list[dict], out_dir: str) -> None:
  """``gpu_bench.json`` (everything) and ``gpu_bench.md`` (tables)."""
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "gpu_bench.json"), "w") as f:
    json.dump(results, f, indent=1)
  ok = [r for r in results if r["status"] == "ok"]
  device = ok[0]["device"] if ok else "unknown device"
  versions = ", ".join(dict.fromkeys(
      f"{k} {r[k]}" for r in ok for k in ("jax", "torch") if r.get(k)))
  lines = [f"# zero_jax GPU benchmark: {device}", "",
           f"`PYTHONPATH=. python experiments/gpu_bench.py` ({versions}); GPT "
           "(vocabulary 50304; 256 with --tiny), bf16 compute, fp32 master "
           "and AdamW state, one device. JAX: attention, remat and loss chunk as in the "
           "columns (attention auto: cuDNN's flash attention on an NVIDIA "
           "GPU). torch: SDPA attention, bf16 autocast. MFU = (6Ψ + "
           "12·L·T·d) x tokens/s / bf16 peak. Memory: the compiled step's "
           "device bytes (JAX: arguments + outputs + temporaries - aliased) "
           "and the device's peak in use (JAX `memory_stats()`, torch "
           "`max_memory_allocated()`).", "",
           "| model | Ψ | mode | attention | remat | loss chunk | batch x seq "
           "| step (s) | tokens/s | MFU | step device GiB | peak in use GiB "
           "| status |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  gib = 1 / 2**30
  for r in results:
    torch = r["mode"] in TORCH_MODES
    lines.append(
        f"| {r['size']} | {_fmt(r.get('params'), ',.0f')} | {r['mode']} | "
        f"{'sdpa' if torch else r.get('attention')} | {r.get('remat')} | "
        f"{'-' if torch else r.get('loss_chunk')} | "
        f"{r['batch']} x {r['seq_len']} | {_fmt(r.get('step_s'), '.3f')} | "
        f"{_fmt(r.get('tokens_per_s'), ',.0f')} | "
        f"{_fmt(r.get('mfu'), '.1%')} | "
        f"{_fmt(r.get('compiled_device_bytes'), '.2f', gib)} | "
        f"{_fmt(r.get('peak_bytes_in_use'), '.2f', gib)} | {r['status']} |")
  lines += [""] + _summary(results)
  with open(os.path.join(out_dir, "gpu_bench.md"), "w") as f:
    f.write("\n".join(lines) + "\n")


def plan_runs(args) -> dict[str, list[Run]]:
  """The runs of each plan: ``{"speed", "offload", "capacity"}``."""
  sizes = TINY_SIZES if args.tiny else SIZES
  seq = 32 if args.tiny else 1024
  settings = dict(attention=args.attention, remat=args.remat,
                  loss_chunk=args.loss_chunk or None)
  wanted = lambda modes: [m for m in modes
                          if not args.modes or m in args.modes]
  speed_sizes = args.speed_sizes or (["tiny"] if args.tiny
                                     else ["1.3b", "125m"])
  runs = lambda modes, batch, steps, sizes_: [
      Run(size, mode, batch, seq, steps, args.tiny, **settings)
      for size in sizes_ for mode in wanted(modes)]
  start = list(sizes).index(args.capacity_from or
                            ("tiny" if args.tiny else "1.3b"))
  return {
      "speed": runs(SPEED_MODES + [m for m in OPT_IN_SPEED_MODES
                                   if args.modes and m in args.modes],
                    args.batch, args.steps, speed_sizes),
      "offload": runs(_OFFLOADS, args.batch, args.steps, speed_sizes),
      "capacity": runs(_LADDER_MODES, args.capacity_batch, 3,
                       list(sizes)[start:]),
  }


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--plan", default="speed",
                 choices=("speed", "offload", "capacity", "all"))
  p.add_argument("--tiny", action="store_true",
                 help="tiny models, JAX's in this process: checks the code "
                 "path (CPU tests use it)")
  p.add_argument("--out-dir", default=os.path.join(
      os.path.dirname(os.path.abspath(__file__)), "results"))
  p.add_argument("--batch", type=int, default=16,
                 help="sequences per step in the speed and offload runs")
  p.add_argument("--capacity-batch", type=int, default=4)
  p.add_argument("--steps", type=int, default=6)
  p.add_argument("--attention", default="auto",
                 choices=("auto", "cudnn", "fused", "einsum"),
                 help="GPTConfig.attention of the JAX runs")
  p.add_argument("--remat", default="auto",
                 help="ZeroConfig.remat of the zero_jax runs (the baseline "
                 "uses what zero_jax chose)")
  p.add_argument("--loss-chunk", type=int, default=None,
                 help="GPTConfig.loss_chunk (default 1024; 16 with --tiny; "
                 "0: the whole logits)")
  p.add_argument("--speed-sizes", nargs="*", default=None,
                 choices=sorted(SIZES) + sorted(TINY_SIZES))
  p.add_argument("--capacity-from", default=None,
                 choices=sorted(SIZES) + sorted(TINY_SIZES))
  p.add_argument("--modes", nargs="*", default=None, choices=ALL_MODES,
                 metavar="MODE", help="only these modes (default: all of "
                 "the plan's): " + "; ".join(ALL_MODES))
  p.add_argument("--dry-run", action="store_true",
                 help="print the runs it would do, as JSON lines, and exit")
  p.add_argument("--timeout", type=float, default=420.0,
                 help="seconds per run")
  p.add_argument("--budget", type=float, default=560.0,
                 help="seconds for everything: runs that would start later "
                 "are skipped (results so far are kept)")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.worker:
    _worker_main(args.worker)
    return
  if args.tiny:
    args.batch = args.capacity_batch = 2
    args.steps = 2
  if args.loss_chunk is None:
    args.loss_chunk = 16 if args.tiny else 1024

  if not args.dry_run:
    # (Here, not in argparse's choices: --dry-run does not import jax.)
    from zero_jax.config import REMAT_POLICIES  # pylint: disable=g-import-not-at-top
    if args.remat not in REMAT_POLICIES:
      p.error(f"--remat {args.remat!r}: choose one of "
              f"{', '.join(sorted(REMAT_POLICIES))}")
  plans = plan_runs(args)
  chosen = [n for n in plans if args.plan in (n, "all")]
  planned = {r.mode for n in chosen for r in plans[n]}
  for mode in args.modes or ():
    if mode not in planned:
      p.error(f"--modes {mode!r} is in no run of --plan {args.plan}: "
              "choose --plan all, or the plan that runs it")
  if args.dry_run:
    for name in chosen:
      for run in plans[name]:
        print(json.dumps({**dataclasses.asdict(run), "plan": name,
                          "capacity": name == "capacity"}))
    return
  results: list[dict] = []
  t0 = time.perf_counter()

  def do(run: Run, **extra) -> dict:
    if run.mode == BASELINE and run.remat == "auto":
      # Plain jax.jit at zero_jax's choice for the same size.
      zero = [r for r in results if r["mode"] == ZERO
              and r["size"] == run.size and r["status"] == "ok"]
      run = dataclasses.replace(
          run, remat=zero[-1]["remat"] if zero else "full")
    left = args.budget - (time.perf_counter() - t0)
    if left < 30 and not args.tiny:
      r = {**dataclasses.asdict(run), "status": "skipped (budget)"}
    elif args.tiny and run.mode not in TORCH_MODES:
      r = run_one(run)
    else:
      r = _in_subprocess(run, min(args.timeout, max(left, 30)))
    r.update(extra)
    results.append(r)
    write_results(results, args.out_dir)
    print(f"{run.size:>6} | {run.mode:<44} | {r['status']:<8} | remat "
          f"{r.get('remat')} | tokens/s "
          f"{_fmt(r.get('tokens_per_s'), ',.0f'):>10} | MFU "
          f"{_fmt(r.get('mfu'), '.1%'):>6} | step device GiB "
          f"{_fmt(r.get('compiled_device_bytes'), '.2f', 1 / 2**30)}",
          flush=True)
    return r

  for name in chosen:
    failed = set()
    for run in plans[name]:
      # The capacity ladder goes up until a size fails, per mode.
      if run.mode in failed:
        continue
      if (do(run, capacity=name == "capacity")["status"] != "ok"
          and name == "capacity"):
        failed.add(run.mode)
  print("\n".join(_summary(results)))
  print(f"wrote {args.out_dir}/gpu_bench.json and gpu_bench.md "
        f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
  main()
