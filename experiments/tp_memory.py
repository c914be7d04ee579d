"""ZeRO-3 with tensor parallelism on H100s: per-device memory, and Pa.

Compiles (never runs) the reference GPT's stage-3 train step for N
compile-only GPUs (``zero_jax.analysis.gpu_mesh``, no GPU needed) on a
``(data, model)`` mesh: tensor parallelism (the GPT's own Megatron specs)
over ``model`` inside a node, ZeRO over ``data``, as in the paper's
ZeRO-100B runs. bf16 compute, fp32 master weights and fp32 AdamW
(``optax.adamw``), remat ``"full"``, one sequence per data rank. For

- GPT-13B (d_model 5120, 40 layers, 40 heads) on 64 GPUs, model 8 x data 8,
- GPT-103B (d_model 12288, 56 layers, 96 heads: Ψ >= 100e9) on 256 GPUs,
  model 8 x data 32,

each with ZeRO-R's Pa (``ZeroConfig(partition_activations=True)``) and
without it, and beside them the same N GPUs without tensor parallelism
(model 1), it reports the compiled per-device peak
(``memory_analysis()``: argument + output + temp - alias), the persistent
state per device (fp32 master + Adam's two moments: the per-device shards
of ``engine.abstract_state``'s params and opt_state) against the ideal
12Ψ/(D·M), and the compile time. For Pa it reports what it saves: the
difference of peak and temp bytes with and without it, and the saved layer
inputs themselves, read off the compiled HLO (the stacked residual of the
layer scan, ``(L, B, S/M, d)`` per device with Pa, ``(L, B, S, d)``
without), against the bytes of the layer inputs ``L·B·S·d`` that the step
would save whole: Pa must save at least (M-1)/M of them.

Each step compiles in a subprocess (a failure or a timeout costs only its
row); results are written after every row::

  PYTHONPATH=. python experiments/tp_memory.py --target h100 \\
      --out-dir experiments/results
  PYTHONPATH=. python experiments/tp_memory.py --quick --out-dir tp_quick
  PYTHONPATH=. python experiments/tp_memory.py --sizes 13b --dry-run

``--quick`` compiles a 7.4M-parameter GPT on 8 GPUs (model 2 x data 4):
the test's shapes (tests/experiments/test_tp_memory.py). ``--render-from``
rewrites the report of an earlier run from its JSON.

Attention is XLA's (``--attention fused``): cuDNN's flash attention, the
GPT's default on GPUs, does not compile with a ``model`` axis inside the
engine's shard_map (JAX's cuDNN partitioner raises ``'GSPMDSharding' object
has no attribute 'spec'``; jax 0.10.2 and 0.12.0.1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time

GIB = 2 ** 30
# name: GPT shape and mesh. Vocabulary 50304 = 8 x 6288 (vocabulary-parallel
# over 8 model ranks); heads of 128 features, divisible by 8.
SIZES = {
    "13b": dict(d_model=5120, n_layers=40, n_heads=40, vocab=50304,
                seq_len=2048, devices=64, model=8),
    "100b": dict(d_model=12288, n_layers=56, n_heads=96, vocab=50304,
                 seq_len=2048, devices=256, model=8),
}
# 7.4M parameters on 8 GPUs, model 2 x data 4. The leaves the model keeps
# whole (position embedding, layer norms, row-parallel biases) are held by
# every model rank: (M-1)x their share of Ψ above 12Ψ/(DM), so the sequence
# is short (the position embedding is S x d). S, S/M, d and 4d all differ,
# so no weight stack has the saved layer inputs' shape.
QUICK_SIZES = {
    "quick": dict(d_model=256, n_layers=8, n_heads=8, vocab=2048,
                  seq_len=128, devices=8, model=2),
}
# Adam with mixed precision: fp32 master + two fp32 moments (the paper's K).
STATE_BYTES_PER_PARAM = 12


@dataclasses.dataclass(frozen=True)
class Case:
  """One compiled step: a GPT shape on ``devices`` GPUs, ``model``-way
  tensor parallel, with or without Pa."""

  size: str
  d_model: int
  n_layers: int
  n_heads: int
  vocab: int
  seq_len: int
  devices: int
  model: int
  pa: bool
  target: str = "h100"
  micro_batch: int = 1
  attention: str = "fused"
  loss_chunk: int | None = None

  @property
  def data(self) -> int:
    """Data-parallel ranks D = devices / model."""
    return self.devices // self.model

  @property
  def label(self) -> str:
    pa = "Pa" if self.pa else "no Pa"
    return (f"{self.size} on {self.devices} {self.target} (model "
            f"{self.model} x data {self.data}, {pa})")


def param_count(d: int, layers: int, vocab: int, seq_len: int,
                d_ff: int | None = None) -> int:
  """Ψ of the reference GPT (``zero_jax.models.GPT``), by formula: per
  layer 2 layer norms, QKV without bias, attention-out and MLP with
  biases; token and position embeddings, final norm, untied head. The
  worker checks it against the model's own count."""
  f = 4 * d if d_ff is None else d_ff
  per_layer = 4 * d + 3 * d * d + d * d + d + d * f + f + f * d + d
  return layers * per_layer + 2 * vocab * d + seq_len * d + 2 * d


# ------------------------------------------------------------------ worker


def saved_carry(hlo: str, case: Case) -> dict | None:
  """The stacked layer inputs that the layer scan saves for backward,
  found in the compiled (per-device) HLO by shape: ``dtype[L, B, s, d]``
  with ``s`` the sequence (S without Pa, S/M with it). Returns the largest
  such buffer: ``{"shape", "dtype", "bytes", "seq"}``, or None if none is
  found."""
  itemsize = {"bf16": 2, "f16": 2, "f32": 4}
  b = case.micro_batch
  seqs = {case.seq_len, case.seq_len // case.model}
  pattern = re.compile(rf"\b(bf16|f16|f32)\[{case.n_layers},{b},"
                       rf"(\d+),{case.d_model}\]")
  best = None
  for m in pattern.finditer(hlo):
    dtype, s = m.group(1), int(m.group(2))
    if s not in seqs:
      continue
    nbytes = case.n_layers * b * s * case.d_model * itemsize[dtype]
    if best is None or nbytes > best["bytes"]:
      best = {"shape": m.group(0)[len(dtype):], "dtype": dtype,
              "bytes": nbytes, "seq": s}
  return best


def layout_state_bytes(params, case: Case, replicated: list[str]) -> float:
  """The state bytes per device that the layout predicts, from the
  model's own ``model`` specs (its Flax metadata): 12 bytes per parameter,
  split over the M model ranks where the model splits the leaf, and over
  the D data ranks unless the plan replicates it (``replicated``: leaves
  too small to shard). Leaves the model keeps whole are held by every
  model rank, so this exceeds 12Ψ/(DM) by (M-1)x their share."""
  # pylint: disable=g-import-not-at-top
  import jax
  from flax import nnx
  # pylint: enable=g-import-not-at-top
  specs = nnx.to_flat_state(nnx.get_partition_spec(params))
  values = dict(nnx.to_flat_state(params))
  total = 0.0
  for path, spec in specs:
    name = "/".join(str(k) for k in path)
    split = "model" in jax.tree.leaves(tuple(spec.get_value()))
    ranks = ((case.model if split else 1) *
             (1 if name in replicated else case.data))
    total += (STATE_BYTES_PER_PARAM *
              math.prod(values[path].get_value().shape) / ranks)
  return total


def run_case(case: Case, hlo_dir: str | None = None) -> dict:
  """Compiles ``case``'s step and measures it (in this process); writes
  its HLO text to ``hlo_dir`` if given."""
  # pylint: disable=g-import-not-at-top
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  import zero_jax as zj
  from zero_jax import analysis
  from zero_jax.models import GPT, GPTConfig, make_loss_fn
  # pylint: enable=g-import-not-at-top

  # Compile-only GPUs first, before anything touches JAX's devices.
  mesh = analysis.gpu_mesh(case.target, case.devices, model=case.model)
  cfg = GPTConfig(vocab_size=case.vocab, seq_len=case.seq_len,
                  d_model=case.d_model, n_layers=case.n_layers,
                  n_heads=case.n_heads, attention=case.attention,
                  loss_chunk=case.loss_chunk)
  # Shapes only (with the specs' metadata): no weight is materialised.
  graphdef, params = nnx.split(
      nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  psi = analysis.param_count(params)
  formula = param_count(case.d_model, case.n_layers, case.vocab,
                        case.seq_len)
  if psi != formula:
    raise AssertionError(f"the GPT has {psi} parameters, the formula says "
                         f"{formula}: update param_count")
  engine = zj.Engine(
      make_loss_fn(graphdef), optax.adamw(1e-4),
      zj.ZeroConfig(stage=3, compute_dtype="bfloat16", remat="full",
                    partition_activations=case.pa,
                    # (The per-device step, as its recorded results.)
                    loss_scope="per_device"), mesh)
  batch = {"tokens": jax.ShapeDtypeStruct(
      (case.micro_batch * case.data, case.seq_len + 1), jnp.int32)}
  t0 = time.perf_counter()
  compiled = analysis.compile_step(engine, params, batch)
  compile_s = time.perf_counter() - t0
  fields = analysis.train_state_bytes(engine.abstract_state(params))
  # Persistent model state: the fp32 master and the optimizer state.
  state = fields["params"] + fields["opt_state"]
  ideal = STATE_BYTES_PER_PARAM * psi / case.devices
  mem = compiled.memory
  batch_bytes = analysis.per_device_bytes(
      analysis.abstract_batch(engine, batch))
  carry = saved_carry(compiled.hlo, case)
  layer_inputs = (case.n_layers * case.micro_batch * case.seq_len *
                  case.d_model * (2 if carry is None or carry["dtype"] !=
                                  "f32" else 4))
  replicated = [path for path, lp in engine.param_plan.rows()
                if not lp.sharded]
  layout = layout_state_bytes(params, case, replicated)
  if hlo_dir:
    os.makedirs(hlo_dir, exist_ok=True)
    name = f"{case.size}_n{case.devices}_m{case.model}_pa{int(case.pa)}.hlo"
    with open(os.path.join(hlo_dir, name), "w", encoding="utf-8") as f:
      f.write(compiled.hlo)
  return {
      "status": "ok", "psi": psi, "compile_s": compile_s,
      "peak_bytes": mem.peak, "argument_bytes": mem.argument,
      "output_bytes": mem.output, "temp_bytes": mem.temp,
      "alias_bytes": mem.alias, "state_bytes": state,
      "state_fields_bytes": fields, "batch_bytes": batch_bytes,
      # What the step takes besides the whole train state and the batch
      # (0: the compiled arguments are exactly the state and the batch).
      "argument_minus_state_and_batch": (mem.argument - sum(fields.values())
                                         - batch_bytes),
      "ideal_state_bytes": ideal, "state_ratio": state / ideal,
      "layout_state_bytes": layout, "layout_ratio": state / layout,
      "saved_carry": carry, "layer_input_bytes": layer_inputs,
      "replicated_params": replicated,
      "mesh": dict(mesh.shape), "jax": jax.__version__,
  }


def _worker_main(spec: str, hlo_dir: str | None) -> None:
  case = Case(**json.loads(spec))
  print("RESULT " + json.dumps(run_case(case, hlo_dir)), flush=True)


# ------------------------------------------------------------------ parent


def _in_subprocess(case: Case, timeout: float,
                   hlo_dir: str | None) -> dict:
  env = dict(os.environ)
  # Compile-only GPUs need no GPU; a real one here is left alone.
  env.setdefault("JAX_PLATFORMS", "cpu")
  cmd = [sys.executable, os.path.abspath(__file__), "--worker",
         json.dumps(dataclasses.asdict(case))]
  if hlo_dir:
    cmd += ["--hlo-dir", hlo_dir]
  t0 = time.perf_counter()
  try:
    out = subprocess.run(cmd, capture_output=True, text=True,
                         timeout=timeout, env=env)
  except subprocess.TimeoutExpired:
    return {"status": f"did not compile within {timeout:.0f} s",
            "wall_s": time.perf_counter() - t0}
  for line in out.stdout.splitlines():
    if line.startswith("RESULT "):
      return {**json.loads(line[7:]), "wall_s": time.perf_counter() - t0}
  text = (out.stdout + out.stderr).strip()
  last = text.splitlines()[-1] if text else f"exit {out.returncode}"
  return {"status": f"error: {last[:300]}", "error": text[-4000:],
          "wall_s": time.perf_counter() - t0}


def plan_cases(args: argparse.Namespace) -> list[Case]:
  """For each size: model M with Pa, without Pa, then model 1."""
  sizes = QUICK_SIZES if args.quick else SIZES
  cases = []
  for name in args.sizes or list(sizes):
    if name not in sizes:
      raise SystemExit(f"--sizes: unknown size {name!r}; known: "
                       f"{', '.join(sizes)}")
    shape = dict(sizes[name])
    if args.model is not None:
      shape["model"] = args.model
    if args.devices is not None:
      shape["devices"] = args.devices
    common = dict(size=name, target=args.target,
                  micro_batch=args.micro_batch, attention=args.attention,
                  loss_chunk=args.loss_chunk, **shape)
    m = shape["model"]
    if m < 2 or shape["devices"] % m:
      raise SystemExit(f"--model must be >= 2 and divide the {shape['devices']}"
                       f" devices, got {m}")
    cases += [Case(**common, pa=True), Case(**common, pa=False),
              Case(**dict(common, model=1), pa=False)]
  return cases


# ----------------------------------------------------------------- report


def pa_savings(results: list[dict]) -> list[dict]:
  """Per size: what Pa saves on the same model-M step, against the
  (M-1)/M share of the layer inputs it must save at least."""
  out = []
  for on in results:
    if not on["pa"] or on["status"] != "ok":
      continue
    off = next((r for r in results if r["size"] == on["size"] and
                r["model"] == on["model"] and not r["pa"] and
                r["status"] == "ok"), None)
    if off is None:
      continue
    m = on["model"]
    inputs = off["layer_input_bytes"]
    required = (m - 1) / m * inputs
    carry = lambda r: (r["saved_carry"] or {}).get("bytes")
    carry_saving = (None if carry(on) is None or carry(off) is None else
                    carry(off) - carry(on))
    row = {
        "size": on["size"], "model": m, "layer_input_bytes": inputs,
        "required_saving_bytes": required,
        "saved_carry_without": off["saved_carry"],
        "saved_carry_with": on["saved_carry"],
        "carry_saving_bytes": carry_saving,
        "peak_saving_bytes": off["peak_bytes"] - on["peak_bytes"],
        "temp_saving_bytes": off["temp_bytes"] - on["temp_bytes"],
    }
    for what in ("carry", "peak", "temp"):
      saving = row[f"{what}_saving_bytes"]
      row[f"{what}_saving_ok"] = (saving is not None and
                                  saving >= required)
    out.append(row)
  return out


def whole_params(d: int, layers: int, seq_len: int) -> int:
  """Parameters the GPT's specs keep whole over ``model``: the position
  embedding, the final and per-layer layer norms and the row-parallel
  biases (attention-out, MLP-out)."""
  return seq_len * d + 6 * layers * d + 2 * d


def render(results: list[dict], command: str, budget: float) -> str:
  """The markdown report of ``results`` (rows of ``main``)."""
  ok = [r for r in results if r["status"] == "ok"]
  # GiB for the full sizes, MiB for --quick's.
  unit, name = ((GIB, "GiB") if any(r["peak_bytes"] >= GIB / 4 for r in ok)
                else (2 ** 20, "MiB"))

  def b(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x / unit:.{digits}f}"

  first = results[0] if results else {}
  jax_version = next((r["jax"] for r in ok), "?")
  lines = [
      f"# ZeRO-3 with tensor parallelism on {first.get('target')}s: "
      "per-device memory and Pa", "",
      f"`{command}`", "",
      f"Compiled (never run) for compile-only GPUs (jax {jax_version}): "
      "the reference GPT (`zero_jax.models.GPT`, Megatron tensor-parallel "
      "specs over `model`), ZeRO stage 3 over `data`, bf16 compute, fp32 "
      "master and fp32 AdamW (`optax.adamw`), remat `full`, sequence "
      f"{first.get('seq_len')}, micro-batch {first.get('micro_batch')} per "
      f"data rank, attention `{first.get('attention')}`, loss_chunk "
      f"{first.get('loss_chunk')}. Peak: `memory_analysis()` argument + "
      "output + temp - alias, per device. State: fp32 master + Adam mu "
      "and nu per device (the shards of `engine.abstract_state`'s params "
      "and opt_state); ideal 12Ψ/(D·M) with D data and M model ranks. "
      "State / layout: against what the layout predicts from the model's "
      "own specs (the leaves the model keeps whole are held by each of "
      "the M model ranks, split over D only). Saved carry: the layer "
      "scan's stacked layer inputs in the compiled HLO, per device.", "",
      f"| model | Ψ | devices | model x data | Pa | peak {name} | temp "
      f"{name} | state {name} | 12Ψ/(DM) {name} | ratio | state / layout "
      "| saved carry | compile s |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in results:
    pa = "-" if r["model"] == 1 else ("on" if r["pa"] else "off")
    psi = (f"{r['psi'] / 1e9:.2f}B" if r["psi"] >= 1e9 else
           f"{r['psi'] / 1e6:.2f}M")
    head = (f"| {r['size']} | {psi} | {r['devices']} | "
            f"{r['model']} x {r['devices'] // r['model']} | {pa} | ")
    if r["status"] != "ok":
      lines.append(head + f"{r['status']} |" + " |" * 7)
      continue
    c = r["saved_carry"]
    carry = ("-" if c is None else
             f"`{c['dtype']}{c['shape']}` {b(c['bytes'])} {name}")
    lines.append(
        head + f"{b(r['peak_bytes'])} | {b(r['temp_bytes'])} | "
        f"{b(r['state_bytes'], 3)} | {b(r['ideal_state_bytes'], 3)} | "
        f"{r['state_ratio']:.4f} | {r['layout_ratio']:.6f} | {carry} | "
        f"{r['compile_s']:.0f} |")
  lines += ["", "## Pa: what partitioning the saved layer inputs saves", "",
            "The same model-M step with and without "
            "`partition_activations`. Layer inputs: L·B·S·d in the carry's "
            "dtype, what the step saves whole without Pa; Pa must save at "
            "least (M-1)/M of them.", "",
            f"| model | M | layer inputs {name} | (M-1)/M {name} | saved "
            f"carry without -> with | carry saving {name} | peak saving "
            f"{name} | temp saving {name} |",
            "|---|---|---|---|---|---|---|---|"]
  shape = lambda c: "-" if c is None else f"`{c['dtype']}{c['shape']}`"
  for p in pa_savings(results):
    mark = lambda k: "" if p[f"{k}_saving_ok"] else " (below)"
    lines.append(
        f"| {p['size']} | {p['model']} | {b(p['layer_input_bytes'], 3)} | "
        f"{b(p['required_saving_bytes'], 3)} | "
        f"{shape(p['saved_carry_without'])} -> "
        f"{shape(p['saved_carry_with'])} | "
        f"{b(p['carry_saving_bytes'], 3)}{mark('carry')} | "
        f"{b(p['peak_saving_bytes'], 3)}{mark('peak')} | "
        f"{b(p['temp_saving_bytes'], 3)}{mark('temp')} |")
  lines += ["", "## Checks", ""]
  for r in results:
    if r["status"] != "ok":
      lines.append(f"- {r['size']}, model {r['model']}: {r['status']}")
    elif r["model"] > 1:
      fits = "under" if r["peak_bytes"] < budget else "OVER"
      whole = whole_params(r["d_model"], r["n_layers"], r["seq_len"])
      share = whole / r["psi"]
      lines.append(
          f"- {r['size']}, model {r['model']}, Pa "
          f"{'on' if r['pa'] else 'off'}: peak {b(r['peak_bytes'])} "
          f"{name}, {fits} {budget / GIB:.0f} GiB. State / 12Ψ/(DM) = "
          f"{r['state_ratio']:.4f}: the {whole / 1e6:.2f}M parameters the "
          f"model keeps whole are on all {r['model']} model ranks, (M-1) x "
          f"{share:.3%} of Ψ = {(r['model'] - 1) * share:.2%} over. "
          "Compiled arguments - train state - batch = "
          f"{r['argument_minus_state_and_batch']} bytes.")
  for size in dict.fromkeys(r["size"] for r in ok):
    rows = {(r["model"], r["pa"]): r for r in ok if r["size"] == size}
    one = rows.get((1, False))
    for (m, pa), r in sorted(rows.items()):
      if m > 1 and one is not None:
        lines.append(
            f"- {size}: model {m} (Pa {'on' if pa else 'off'}) peak / "
            f"model 1 peak at the same {r['devices']} devices = "
            f"{r['peak_bytes'] / one['peak_bytes']:.3f}.")
  if first.get("attention") in ("fused", "einsum"):
    lines += ["", f"Attention `{first.get('attention')}`: cuDNN's flash "
              "attention (`auto`, the GPT's default on GPUs, or `cudnn`) "
              "does not compile with a `model` axis inside the engine's "
              "shard_map (JAX's cuDNN partitioner fails: `'GSPMDSharding' "
              "object has no attribute 'spec'`)."]
  return "\n".join(lines) + "\n"


def write(results: list[dict], out_dir: str, command: str,
          budget: float) -> tuple[str, str]:
  """``tp_memory_<target>.json`` and ``.md`` in ``out_dir``."""
  os.makedirs(out_dir, exist_ok=True)
  target = results[0]["target"]
  base = os.path.join(out_dir, f"tp_memory_{target}")
  with open(base + ".json", "w", encoding="utf-8") as f:
    json.dump({"command": command, "budget_bytes": budget, "rows": results,
               "pa": pa_savings(results)}, f, indent=1)
  with open(base + ".md", "w", encoding="utf-8") as f:
    f.write(render(results, command, budget))
  return base + ".json", base + ".md"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--target", default="h100",
                 help="GPU to compile for (h100, h200, a100-80gb)")
  p.add_argument("--quick", action="store_true",
                 help="a GPT of a few million parameters on 8 GPUs "
                 "(model 4 x data 2) instead of 13B and 103B")
  p.add_argument("--sizes", nargs="*", default=None,
                 help=f"sizes to compile (default all: {', '.join(SIZES)}; "
                 f"with --quick: {', '.join(QUICK_SIZES)})")
  p.add_argument("--model", type=int, default=None,
                 help="tensor-parallel ranks M (default: the size's, 8 or 4)")
  p.add_argument("--devices", type=int, default=None,
                 help="GPUs N (default: the size's)")
  p.add_argument("--micro-batch", type=int, default=1,
                 help="sequences per data rank")
  p.add_argument("--attention", default="fused",
                 help="GPTConfig.attention (default fused: XLA's; cuDNN's "
                 "does not compile under a 'model' axis, see the report)")
  p.add_argument("--loss-chunk", type=int, default=None,
                 help="GPTConfig.loss_chunk (default: the loss whole)")
  p.add_argument("--budget-gib", type=float, default=76.0,
                 help="the per-device peak the model-M steps must stay under")
  p.add_argument("--case-timeout", type=float, default=1800.0,
                 help="seconds one compile may take before its row says so")
  p.add_argument("--out-dir", default=None,
                 help="write tp_memory_<target>.json and .md here")
  p.add_argument("--hlo-dir", default=None,
                 help="write each compiled step's HLO text here")
  p.add_argument("--render-from", default=None, metavar="PATH.json",
                 help="compile nothing: rewrite the .md beside an earlier "
                 "run's JSON (the report's layout changed)")
  p.add_argument("--dry-run", action="store_true",
                 help="print the cases as JSON lines, compile nothing")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  if args.worker is not None:
    _worker_main(args.worker, args.hlo_dir)
    return
  if args.render_from is not None:
    # The report of an earlier run, rewritten beside its JSON.
    with open(args.render_from, encoding="utf-8") as f:
      saved = json.load(f)
    md = os.path.splitext(args.render_from)[0] + ".md"
    with open(md, "w", encoding="utf-8") as f:
      f.write(render(saved["rows"], saved["command"],
                     saved["budget_bytes"]))
    print(f"wrote {md}", file=sys.stderr)
    return
  cases = plan_cases(args)
  if args.dry_run:
    for case in cases:
      print(json.dumps({**dataclasses.asdict(case),
                        "psi": param_count(case.d_model, case.n_layers,
                                           case.vocab, case.seq_len)}))
    return
  command = "PYTHONPATH=. python experiments/tp_memory.py " + shlex.join(
      sys.argv[1:] if argv is None else argv)
  budget = args.budget_gib * GIB
  results = []
  for i, case in enumerate(cases, 1):
    print(f"[{i}/{len(cases)}] {case.label}: compiling", file=sys.stderr,
          flush=True)
    r = {**dataclasses.asdict(case), **_in_subprocess(
        case, args.case_timeout, args.hlo_dir)}
    if r["status"] == "ok":
      print(f"[{i}/{len(cases)}] {case.label}: peak "
            f"{r['peak_bytes'] / GIB:.2f} GiB, state "
            f"{r['state_bytes'] / GIB:.3f} GiB (x"
            f"{r['state_ratio']:.4f} of 12Ψ/(DM)), compiled in "
            f"{r['compile_s']:.0f} s", file=sys.stderr, flush=True)
    else:
      r.setdefault("psi", param_count(case.d_model, case.n_layers,
                                      case.vocab, case.seq_len))
      print(f"[{i}/{len(cases)}] {case.label}: {r['status']}",
            file=sys.stderr, flush=True)
    results.append(r)
    if args.out_dir:
      write(results, args.out_dir, command, budget)
  text = render(results, command, budget)
  print(text)
  if args.out_dir:
    paths = write(results, args.out_dir, command, budget)
    print(f"wrote {paths[0]} and {paths[1]}", file=sys.stderr)


if __name__ == "__main__":
  main()
