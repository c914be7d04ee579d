"""Per-device memory and communication of ZeRO stages 0-3 and of GSPMD FSDP.

Compiles (never runs) one train step of the reference GPT with fp32 AdamW
at every ZeRO stage and at N = 1, 2, 4, 8 devices, and two peers that use no
explicit collectives, one plain ``jax.jit`` of value_and_grad + optax with
params and optimizer state sharded over ``data`` like ZeRO-3 and every
collective left to GSPMD:

- FSDP: MaxText-style, the activations pinned to batch sharding at every
  block boundary (MaxText's ``activation_batch`` logical constraint);
- GSPMD: only the inputs' shardings given, nothing pinned inside.

For each it reports the train state's bytes per device and the compiled
step's temporaries and peak (``compiled.memory_analysis()``) next to the
paper's model-state formula for fp32 Adam (4Ψ params + 4Ψ grads + 8Ψ
moments), and the collectives per step read off the compiled HLO (loop trip
counts applied) in units of Ψ, next to the paper's volumes: stage 0
all-reduce Ψ (2Ψ of traffic: an all-reduce is a reduce-scatter plus an
all-gather), stages 1-2 reduce-scatter Ψ + all-gather Ψ = 2Ψ, stage 3 (and
FSDP) all-gather 2Ψ + reduce-scatter Ψ = 3Ψ.

On a machine without an accelerator, 8 CPU devices are simulated::

  PYTHONPATH=. python experiments/memory_sweep.py
  PYTHONPATH=. python experiments/memory_sweep.py --d-model 128 --devices 2,8 \\
      --out sweep.md --plot sweep.png

``--compile h100`` compiles every step for N H100s instead
(``zero_jax.analysis``, the ``gpu-compile`` extra; no GPU needed): what a
GPU user runs, with 16-bit collectives kept, real reduce-scatters from
GSPMD and the GPU scheduler::

  PYTHONPATH=. python experiments/memory_sweep.py --compile h100 --devices 8

``--plot-from`` redraws the plot of a recorded table without compiling::

  PYTHONPATH=. python experiments/memory_sweep.py \\
      --plot-from experiments/results/memory_sweep.md
"""

import argparse
import os
import dataclasses
import shlex
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx

import zero_jax as zj
from zero_jax import analysis
from zero_jax.analysis import (paper_model_state_bytes, param_count,
                               per_device_bytes)
from zero_jax.layout import plan_leaf
from zero_jax.models import GPT, GPTConfig, make_loss_fn, pinned_gpt_loss

zj.simulate_cpu_devices(8)  # before anything lists devices

RUNS = ("0", "1", "2", "3", "fsdp", "gspmd")
LABELS = {"fsdp": "FSDP", "gspmd": "GSPMD"}
# The paper's communication volume per step in Ψ, an all-reduce counted as
# the reduce-scatter + all-gather it is made of (section 7). The peers lay
# the state out like ZeRO-3, so theirs is stage 3's.
PAPER_TRAFFIC = {"0": 2.0, "1": 2.0, "2": 2.0, "3": 3.0, "fsdp": 3.0,
                 "gspmd": 3.0}
# The peers replicate exactly the leaves the engine replicates.
MIN_SHARD_ELEMENTS = zj.ZeroConfig().min_shard_elements


def parse_args() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--devices", default="1,2,4,8",
                 help="comma-separated device counts N")
  p.add_argument("--d-model", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--batch-size", type=int, default=16,
                 help="global batch (sequences); divisible by every N")
  p.add_argument("--out", default=None, metavar="PATH.md",
                 help="also write the table and notes as markdown")
  p.add_argument("--plot", default=None, metavar="PATH.png",
                 help="write a bar chart of memory and traffic")
  p.add_argument("--compile", default=None, metavar="TARGET",
                 help="compile for N GPUs of TARGET (h100, h200, a100-80gb) "
                 "instead of the simulated CPU devices")
  p.add_argument("--hlo-dir", default=None, metavar="DIR",
                 help="write each compiled step's HLO text here")
  p.add_argument("--plot-from", default=None, metavar="PATH.md",
                 help="compile nothing: plot the table of an earlier --out "
                 "(to --plot, else beside it as .png)")
  return p.parse_args()


@dataclasses.dataclass
class Row:
  """One compiled step: ``run`` is a ZeRO stage ("0".."3") or a peer.

  Bytes are per device; ag/rs/ar/other are collective volumes per step in
  units of Ψ elements (see ``comm_in_psi``).
  """

  run: str
  n: int
  psi: int
  state: int
  paper: float
  temp: int
  peak: int
  ag: float
  rs: float
  ar: float
  other: float

  @property
  def traffic(self) -> float:
    return traffic(vars(self))

  @property
  def paper_traffic(self) -> float | None:
    # One device needs no communication: the paper's volumes are for N > 1.
    return PAPER_TRAFFIC[self.run] if self.n > 1 else None


def comm_in_psi(hlo_text: str, psi: int, n: int) -> dict[str, float]:
  """Per-step collective volumes in Ψ, each counted by its full operand
  (``zero_jax.analysis.comm_in_psi``: reduce-scatters scaled by N to the
  full gradient they reduce), grouped as the table's columns; "other" is
  all-to-all plus collective-permute."""
  c = analysis.comm_in_psi(analysis.summarize(hlo_text), psi, n)
  return {"ag": c.get("all-gather", 0.0), "rs": c.get("reduce-scatter", 0.0),
          "ar": c.get("all-reduce", 0.0),
          "other": c.get("all-to-all", 0.0) + c.get("collective-permute", 0.0)}


def traffic(comm: dict[str, float]) -> float:
  """Total volume in Ψ: an all-reduce moves what a reduce-scatter plus an
  all-gather move, so it counts twice (as in the paper)."""
  return comm["ag"] + comm["rs"] + 2 * comm["ar"] + comm["other"]


# ------------------------------------------------------------------- peers


def compile_peer(loss_fn, tx, params, batch, mesh):
  """One plain jit with sharded in/out; GSPMD inserts every collective
  (``zero_jax.analysis.compile_gspmd_step``: params and optimizer state
  laid out by ZeRO-3's plan and threshold, the batch split on its leading
  dimension, nothing materialised).

  Returns:
    The compiled step's memory and HLO text, and its (params, opt_state)
    bytes per device.
  """
  state, c = analysis.compile_gspmd_step(
      loss_fn, tx, params, batch, mesh,
      min_shard_elements=MIN_SHARD_ELEMENTS)
  return c.memory, c.hlo, per_device_bytes(state)


def compile_zero(loss_fn, tx, params, batch, mesh, stage: int):
  """The engine's compiled step (memory, HLO text) and its train state's
  bytes per device, from shapes (``zero_jax.analysis.compile_step``).

  Without prefetch: the paper's schedule, each layer gathered where it is
  used. (Prefetch, the default, also gathers and reduces its first and
  last layers twice: 4/L of the layers' Ψ more; experiments/stage3_bench.py
  measures it.) The per-device loss: its own collectives are the paper's
  on any backend, where a global loss's are the compiler's, which on CPUs
  all-reduces what it reduce-scatters on GPUs."""
  engine = zj.Engine(loss_fn, tx, zj.ZeroConfig(stage=stage, prefetch=False,
                                                loss_scope="per_device"),
                     mesh)
  c = analysis.compile_step(engine, params, batch)
  return c.memory, c.hlo, per_device_bytes(engine.abstract_state(params))


def make_mesh(args, n: int):
  """N simulated CPU devices, or N compile-only GPUs with ``--compile``."""
  if args.compile:
    return analysis.gpu_mesh(args.compile, n)
  return zj.make_mesh(num_devices=n)


# ------------------------------------------------------------------- sweep


def sweep(args, graphdef, config, tx, params, batch) -> list[Row]:
  psi = param_count(params)
  ns = [int(n) for n in args.devices.split(",")]
  loss_fn = make_loss_fn(graphdef)
  total = len(RUNS) * len(ns)
  rows = []
  t0 = time.perf_counter()
  for run in RUNS:
    for n in ns:
      mesh = make_mesh(args, n)
      t = time.perf_counter()
      if run == "fsdp":
        mem, text, state = compile_peer(
            pinned_gpt_loss(graphdef, mesh), tx, params, batch,
            mesh)
      elif run == "gspmd":
        mem, text, state = compile_peer(loss_fn, tx, params, batch, mesh)
      else:
        mem, text, state = compile_zero(loss_fn, tx, params, batch, mesh,
                                        int(run))
      if args.hlo_dir:
        with open(os.path.join(args.hlo_dir, f"{run}_n{n}.hlo"), "w") as f:
          f.write(text)
      # FSDP partitions what ZeRO-3 partitions.
      paper = paper_model_state_bytes(psi, n, int(run) if run.isdigit() else 3,
                                      param_bytes=4, grad_bytes=4, k=8)
      rows.append(Row(run, n, psi, state, paper, mem.temp, mem.peak,
                      **comm_in_psi(text, psi, n)))
      print(f"[{len(rows):2d}/{total}] {label(run):>7} N={n}: compiled in "
            f"{time.perf_counter() - t:4.1f}s (elapsed "
            f"{time.perf_counter() - t0:5.1f}s)", flush=True)
  return rows


# ------------------------------------------------------------------ report


def label(run: str) -> str:
  return LABELS.get(run, f"stage {run}")


def mib(b: float) -> str:
  return f"{b / 2**20:.2f}"


COLUMNS = ("run", "N", "Ψ", "state MiB", "paper MiB", "temp MiB", "peak MiB",
           "AG Ψ", "RS Ψ", "AR Ψ", "other Ψ", "traffic Ψ", "paper traffic Ψ")


def table_cells(rows: list[Row]) -> list[list[str]]:
  cells = []
  for r in rows:
    pt = "-" if r.paper_traffic is None else f"{r.paper_traffic:.2f}"
    cells.append([label(r.run), str(r.n), f"{r.psi:,}", mib(r.state),
                  mib(r.paper), mib(r.temp), mib(r.peak), f"{r.ag:.3f}",
                  f"{r.rs:.3f}", f"{r.ar:.3f}", f"{r.other:.3f}",
                  f"{r.traffic:.3f}", pt])
  return cells


def text_table(rows: list[Row]) -> str:
  cells = table_cells(rows)
  widths = [max(len(c), *(len(r[i]) for r in cells))
            for i, c in enumerate(COLUMNS)]
  fmt = lambda r: " | ".join(c.rjust(w) for c, w in zip(r, widths))
  rule = "-+-".join("-" * w for w in widths)
  lines = [fmt(COLUMNS), rule]
  for i, r in enumerate(cells):
    if i and rows[i].run != rows[i - 1].run:
      lines.append(rule)
    lines.append(fmt(r))
  return "\n".join(lines)


def markdown_table(rows: list[Row]) -> str:
  lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  lines += ["| " + " | ".join(r) + " |" for r in table_cells(rows)]
  return "\n".join(lines)


def notes(rows: list[Row], params, config: GPTConfig, batch_size: int,
          gspmd_2x: float) -> list[str]:
  """What the table shows, with this run's numbers filled in.

  The explanations were checked on the default configuration (reading its
  HLO with ``--hlo-dir``); the numbers are recomputed from this run.
  ``gspmd_2x`` is the GSPMD peer's traffic at the largest N with twice the
  global batch.
  """
  by = {(r.run, r.n): r for r in rows}
  ns = sorted({r.n for r in rows})
  lo, hi = ns[0], ns[-1]
  psi = rows[0].psi
  mb = lambda b: f"{b / 2**20:.2f} MiB"
  out = []

  # Persistent state against the formula: the gap is the gradient buffer.
  gaps = ", ".join(
      f"stage {s}: {(by[s, hi].paper - by[s, hi].state) / psi:.2f}Ψ"
      for s in "0123")
  out.append(
      f"**State vs paper.** The paper's formula minus the measured state at "
      f"N = {hi}, in bytes per parameter: {gaps}, i.e. its 4Ψ fp32 "
      f"gradient at stages 0-1 and 4Ψ/N at 2-3 (4/{hi} = {4 / hi:.2f}). A "
      f"functional JAX step keeps no gradient buffer between steps; gradients "
      f"are step temporaries and show up in temp. Everything else shrinks "
      f"as the formula says: stage 3 at N = {hi} holds "
      f"{by['3', hi].state / by['3', lo].state:.3f} of its N = {lo} state "
      f"(ideal {lo / hi:.3f}; the rest are leaves below "
      f"min_shard_elements = {MIN_SHARD_ELEMENTS}, kept replicated).")

  if ("1", hi) in by and hi > 1:
    saved = by["1", hi].temp - by["2", hi].temp
    grad = 4 * psi * (1 - 1 / hi)
    out.append(
        f"**Stages 1 and 2 hold the same state** (4Ψ replicated params + "
        f"8Ψ/N moments: the engine stores no gradient, so there is none to "
        f"partition). Stage 2's saving is in temp: at N = {hi} it is "
        f"{mb(saved)} below stage 1's, {saved / grad:.2f} of the "
        f"4Ψ(1 - 1/N) = {mb(grad)} a full gradient copy costs over its "
        f"shard, because each layer's gradient is reduce-scattered as "
        f"backward produces it.")

  t0 = [by["0", n].temp for n in ns]
  floor = 8 * psi  # two fp32 gradient copies
  out.append(
      "**Stage 0's temp** falls with N ("
      + ", ".join(f"{mb(t)} at N = {n}" for t, n in zip(t0, ns))
      + f") though its state is constant, because activations are per local "
      f"batch ({batch_size}/N sequences), down to a floor of "
      f"{min(t0) / psi:.1f}Ψ bytes: XLA's buffer assignment "
      f"(`--xla_dump_to`) holds two gradient-sized buffers per stacked "
      f"weight (8Ψ = {mb(floor)}), and the CPU program also keeps the "
      f"updated master and moments apart from the old ones for "
      f"`skip_nonfinite`'s select (with `skip_nonfinite=False` the floor is "
      f"8Ψ; the H100-compiled program fuses the select into the update and "
      f"keeps 8Ψ with it on: memory_sweep_h100.md). Once the local "
      f"activations are small enough they fit in the space those leave.")

  # Stage 3 gathers the sharded leaves scan_layers runs twice (forward,
  # remat'd backward) and the sharded leaves used outside it once.
  sharded = lambda x: plan_leaf(x.shape, hi, 3, MIN_SHARD_ELEMENTS).sharded
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  inside = sum(x.size for p, x in flat
               if "blocks" in jax.tree_util.keystr(p) and sharded(x)) / psi
  outside = sum(x.size for p, x in flat
                if "blocks" not in jax.tree_util.keystr(p) and sharded(x)) / psi
  r3 = by["3", hi]
  out.append(
      f"**Stage 3 all-gathers {r3.ag:.3f}Ψ, not 2Ψ.** The sharded layer "
      f"stacks `scan_layers` runs ({inside:.3f}Ψ) are gathered in forward "
      f"and again in the remat'd backward, but the sharded embeddings and "
      f"head ({outside:.3f}Ψ) are used outside it, gathered once and kept "
      f"for backward: 2 x {inside:.3f} + {outside:.3f} = "
      f"{2 * inside + outside:.3f}. Traffic {r3.traffic:.3f}Ψ vs the "
      f"paper's 3Ψ.")

  if hi > 1:
    f = by["fsdp", hi]
    out.append(
        f"**FSDP reduces gradients with all-reduce, not reduce-scatter** "
        f"(RS {f.rs:.3f}Ψ, AR {f.ar:.3f}Ψ at N = {hi}). In its HLO each "
        f"layer's full gradient is all-reduced inside the backward loop and "
        f"the device's shard is then sliced out (a dynamic-update-slice "
        f"fusion into the sharded gradient stack, and the optimizer fusion "
        f"indexed by partition-id). XLA's CPU pipeline leaves this "
        f"all-reduce + slice as it is (the GPU pipeline has a "
        f"ReduceScatterCreator pass for the pattern; not measured here), so "
        f"on CPU FSDP moves {f.traffic:.2f}Ψ against ZeRO-3's "
        f"{r3.traffic:.2f}Ψ. "
        f"Memory is unaffected (temp {mb(f.temp)} vs stage 3's "
        f"{mb(r3.temp)}): a reduce-scatter, too, takes a layer's full local "
        f"gradient as input. Its all-gather ({f.ag:.3f}Ψ) is per layer like "
        f"stage 3's"
        + (f"; below it because at N = {hi} GSPMD looks tokens up in the "
           f"feature-sharded embedding table and moves the result with "
           f"all-to-all (other = {f.other:.3f}Ψ) instead of gathering the "
           f"table." if f.other > 0 else "."))
    g = by["gspmd", hi]
    g_lo = by["gspmd", ns[1]] if len(ns) > 1 else g
    out.append(
        f"**GSPMD with only the inputs' shardings is not FSDP.** Propagation "
        f"carries the weights' feature-dim sharding into the activations, "
        f"so it gathers, all-reduces and permutes activations "
        f"(shapes like ({batch_size}, {config.seq_len}, {config.d_model}) "
        f"per layer) and never gathers a weight matrix: its volume follows "
        f"the activations, not Ψ (traffic {g_lo.traffic:.2f}Ψ at N = "
        f"{g_lo.n}, {g.traffic:.2f}Ψ at N = {g.n}; {gspmd_2x:.2f}Ψ at N = "
        f"{g.n} with the global batch doubled to {2 * batch_size}). "
        f"MaxText avoids this by constraining activations to batch "
        f"sharding, which is what the FSDP row does.")

  if lo == 1:
    out.append(
        "**N = 1.** GSPMD emits no collective for a one-device mesh (FSDP "
        "and GSPMD rows: 0). The engine's explicit collectives stay in the "
        "HLO with one-member replica groups (`replica_groups={{0}}`), "
        "which move no data: its N = 1 volumes are what the HLO names, not "
        "traffic, and the paper has no volume for one device (-).")
  return out


def plot(rows: list[Row], path: str, title: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib.lines import Line2D  # pylint: disable=g-import-not-at-top
  from matplotlib.patches import Patch  # pylint: disable=g-import-not-at-top

  ns = sorted({r.n for r in rows})
  by = {(r.run, r.n): r for r in rows}
  width = 0.8 / len(RUNS)
  colors = dict(zip(RUNS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
  paper_marker = dict(marker="_", color="k", linestyle="", markersize=10,
                      markeredgewidth=2)
  # Traffic is stacked by collective kind; the hatch tells the kind.
  kinds = (("all-gather", lambda r: r.ag, ""),
           ("reduce-scatter", lambda r: r.rs, "////"),
           ("all-reduce (x2)", lambda r: 2 * r.ar, "xxx"),
           ("all-to-all + permute", lambda r: r.other, "..."))
  fig, (ax_m, ax_c) = plt.subplots(1, 2, figsize=(13, 5.2))
  for i, run in enumerate(RUNS):
    x = np.arange(len(ns)) + (i - (len(RUNS) - 1) / 2) * width
    get = lambda f: np.array([f(by[run, n]) for n in ns])
    # Peak (light) behind the persistent state (solid): state <= peak.
    ax_m.bar(x, get(lambda r: r.peak / 2**20), width, color=colors[run],
             alpha=0.3)
    ax_m.bar(x, get(lambda r: r.state / 2**20), width, color=colors[run])
    ax_m.plot(x, get(lambda r: r.paper / 2**20), **paper_marker)
    bottom = np.zeros(len(ns))
    for _, value, hatch in kinds:
      v = get(value)
      ax_c.bar(x, v, width, bottom=bottom, color=colors[run], hatch=hatch,
               edgecolor="white", linewidth=0)
      bottom += v
    ax_c.plot(x, get(lambda r: np.nan if r.paper_traffic is None
                     else r.paper_traffic), **paper_marker)
  for ax in (ax_m, ax_c):
    ax.set_xticks(np.arange(len(ns)), [f"N = {n}" for n in ns])
  ax_m.set_ylabel("MiB per device")
  ax_m.set_title("train state (solid), compiled step peak (light)")
  ax_c.set_ylabel("Ψ per step")
  ax_c.set_title("collectives in the compiled HLO")
  # One legend for both panels, below them, so no bar is hidden.
  handles = [Patch(color=colors[run], label=label(run)) for run in RUNS]
  handles += [Patch(color="grey", alpha=0.3, label="step peak"),
              Line2D([], [], label="paper formula / volume", **paper_marker)]
  handles += [Patch(facecolor="grey", hatch=hatch, edgecolor="white",
                    label=name) for name, _, hatch in kinds]
  fig.legend(handles=handles, loc="lower center", ncol=6, fontsize=8)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout(rect=(0, 0.1, 1, 1))
  fig.savefig(path, dpi=120)
  print(f"wrote {path}")


def rows_from_markdown(path: str) -> tuple[list[Row], str]:
  """The rows (MiB rounded as written) and plot title of an earlier --out."""
  runs = {label(run): run for run in RUNS}
  rows, setup, where = [], "", ""
  with open(path) as f:
    for line in f:
      if line.startswith("- Model: "):
        setup = line[len("- Model: "):].strip().rstrip(".")
      elif line.startswith("- Measured on "):
        where = line[len("- Measured on "):].split(" (`XLA_FLAGS")[0]
      cells = [c.strip() for c in line.strip().strip("|").split("|")]
      if line.startswith("|") and cells[0] in runs:
        b = lambda c: round(float(c) * 2**20)
        rows.append(Row(runs[cells[0]], int(cells[1]),
                        int(cells[2].replace(",", "")), b(cells[3]),
                        b(cells[4]), b(cells[5]), b(cells[6]),
                        *map(float, cells[7:11])))
  if not rows:
    raise SystemExit(f"no table rows in {path}")
  return rows, f"{setup}; {where}"


# -------------------------------------------------------------------- main


def main() -> None:
  args = parse_args()
  if args.plot_from:
    rows, title = rows_from_markdown(args.plot_from)
    plot(rows, args.plot or os.path.splitext(args.plot_from)[0] + ".png",
         title)
    return
  t_start = time.perf_counter()
  ns = [int(n) for n in args.devices.split(",")]
  for n in ns:
    if args.batch_size % n:
      raise SystemExit(f"--batch-size {args.batch_size} is not divisible by "
                       f"N = {n}")
  if args.hlo_dir:
    os.makedirs(args.hlo_dir, exist_ok=True)
  config = GPTConfig(seq_len=args.seq_len, d_model=args.d_model,
                     n_layers=args.layers, n_heads=args.heads)
  graphdef, params = nnx.split(GPT(config, rngs=nnx.Rngs(0)), nnx.Param)
  tx = optax.adamw(1e-3)
  rng = np.random.default_rng(0)
  batch = {"tokens": rng.integers(0, config.vocab_size,
                                  (args.batch_size, args.seq_len + 1),
                                  dtype=np.int32)}
  psi = param_count(params)
  dev = (analysis.gpu_devices(args.compile, 1) if args.compile else
         jax.devices())[0]
  where = (f"{', '.join(map(str, ns))} {dev.device_kind} GPU(s), compiled "
           "without the GPU (zero_jax.analysis)" if args.compile else
           f"{len(jax.devices())} simulated CPU devices of one host"
           if dev.platform == "cpu" else
           f"{len(jax.devices())} x {dev.device_kind}")
  setup = (f"GPT d_model {config.d_model}, {config.n_layers} layers, "
           f"{config.n_heads} heads, seq {config.seq_len}, vocab "
           f"{config.vocab_size}: Ψ = {psi:,}; global batch "
           f"{args.batch_size}; optax.adamw, fp32")
  print(f"devices: {where}\nmodel: {setup}\n")

  # The FSDP peer's forward is written out (to pin activations): check that
  # it is the same loss before comparing anything.
  mesh = zj.make_mesh(num_devices=max(ns))
  ref = float(jax.jit(make_loss_fn(graphdef))(params, batch))
  pinned = float(jax.jit(pinned_gpt_loss(graphdef, mesh))(params, batch))
  if abs(pinned - ref) > 1e-5 * abs(ref):
    raise SystemExit(f"FSDP loss {pinned} != make_loss_fn's {ref}")
  print(f"FSDP peer's loss = make_loss_fn's: {pinned:.6f} vs {ref:.6f}\n")

  rows = sweep(args, graphdef, config, tx, params, batch)
  # Does GSPMD's traffic follow the activations? Twice the batch, once.
  t = time.perf_counter()
  double = {"tokens": np.concatenate([batch["tokens"]] * 2)}
  _, text, _ = compile_peer(make_loss_fn(graphdef), tx, params, double,
                            make_mesh(args, max(ns)))
  gspmd_2x = traffic(comm_in_psi(text, psi, max(ns)))
  print(f"GSPMD N={max(ns)} at batch {2 * args.batch_size}: compiled in "
        f"{time.perf_counter() - t:4.1f}s")
  print("\n" + text_table(rows))
  # The notes explain the CPU-compiled programs (checked against their
  # HLO); a GPU-compiled sweep prints its table alone.
  note_lines = ([] if args.compile else
                notes(rows, params, config, args.batch_size, gspmd_2x))
  print()
  for line in note_lines:
    print("- " + line.replace("**", ""))
  print(f"\ntotal {time.perf_counter() - t_start:.1f}s")

  if args.plot:
    plot(rows, args.plot, f"{setup}; {where}")
  if args.out:
    cmd = " ".join(["python"] + [shlex.quote(a) for a in sys.argv])
    with open(args.out, "w") as f:
      f.write(
          f"# ZeRO stages vs GSPMD FSDP: memory and communication per device"
          f"\n\n`{cmd}`\n\n"
          f"- Measured on {where} (`XLA_FLAGS={os.environ['XLA_FLAGS']}`), "
          f"jax {jax.__version__}: each step is compiled, never run, and "
          f"the numbers are what XLA's "
          f"{'GPU' if args.compile else dev.platform.upper()} backend "
          f"compiled.\n"
          f"- Model: {setup}.\n"
          f"- state = bytes of the train state's shards on one device "
          f"(params, optimizer state, step); paper = "
          f"`paper_model_state_bytes(Ψ, N, stage, param_bytes=4, "
          f"grad_bytes=4, k=8)` (stage 3's for the peers); temp and peak "
          f"from `compiled.memory_analysis()` (peak = argument + output + "
          f"temp - alias).\n"
          f"- Collectives per step from `zero_jax.analysis.summarize` (loop "
          f"trip counts applied), in Ψ elements: AG = all-gather results, "
          f"RS = reduce-scatter inputs (N x results), AR = all-reduce, other = "
          f"all-to-all + collective-permute; traffic = AG + RS + 2 AR + "
          f"other, as the paper counts an all-reduce.\n"
          f"- FSDP and GSPMD: one `jax.jit` (value_and_grad + adamw, "
          f"donated), params and optimizer state sharded like ZeRO-3 "
          f"(`zero_jax.layout.Plan`), collectives left to GSPMD; FSDP also "
          f"pins activations to batch sharding at each block boundary.\n\n"
          f"{markdown_table(rows)}\n")
      if note_lines:
        f.write("\n## Notes\n\nThe explanations were checked against the "
                "default run's HLO (`--hlo-dir`) and XLA's buffer "
                "assignment; the numbers in them are this run's.\n\n")
      f.write("".join(f"- {line}\n" for line in note_lines))
      if args.plot:
        f.write(f"\n![memory and traffic]({os.path.basename(args.plot)})\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
