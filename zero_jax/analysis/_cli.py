"""Per-device memory and communication of each ZeRO stage, from the shell.

Prints, for every stage asked for, zero_jax's analytic bytes per device
(``zero_jax.analysis.estimate_memory``) next to the ZeRO paper's formula, and
the collectives of one step in multiples of Ψ and in GiB (MiB for small
models). No accelerator or model is needed.

Example::

  $ python -m zero_jax.estimate --params 7.5e9 --devices 64 --stage 3
  $ python -m zero_jax.estimate --params 1.3B --devices 8 \\
      --compute-dtype bf16 --layers 24 --hidden 2048 --seq-len 2048 \\
      --micro-batch 4 --heads 16 --vocab 50257
  $ python -m zero_jax.estimate --compile h100 --devices 8 --stage 3 \\
      --compute-dtype bf16 --layers 24 --hidden 2048 --heads 16 \\
      --vocab 50304 --seq-len 1024 --micro-batch 16
  $ python -m zero_jax.estimate --params 1T --devices 1024 \\
      --model-parallel 16 --stage 3

``--compile TARGET`` also compiles the reference GPT
(``zero_jax.models.GPT``, fused attention, AdamW) of that shape for N GPUs
of the target (``zero_jax.models.compile_gpt``; needs the ``gpu-compile``
extra) and prints the compiled step's device peak, host bytes and
collectives beside the estimate; ``--params`` is then the model's own
count. ``models`` comes after ``analysis`` in the package's order, so
``main`` is handed it (``gpt``): ``python -m zero_jax.estimate`` does.

``--model-parallel M`` combines ZeRO with model parallelism of degree M
(``zero_jax.make_mesh(model=M)``): each device holds the model states of
Ψ/M parameters, sharded over N = devices / (R x M); the communication shown
is ZeRO's, over the data axis (the model-parallel collectives are the
model's own). With ``--compile`` the step compiles on
``gpu_mesh(target, devices, replica=R, model=M)``.

``--params`` takes 7.5e9, 1.3B, 125M or 350k. The paper's column uses
fp16 params and gradients and K = 12 (fp32 master + the optimizer's state)
with ``--compute-dtype``, fp32 params and gradients and K = the optimizer's
without. Activations (Korthikanti et al., arXiv:2205.05198) are estimated
only when the model's shape is given.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from zero_jax.analysis import _aot as aot
from zero_jax.analysis import _comm as comm
from zero_jax.analysis import _memory as memory
from zero_jax.analysis._arguments import (COMPUTE_DTYPES, MAX_BYTES,
                                        build_parser)
from zero_jax.analysis._measure import param_count
from zero_jax.config import ZeroConfig
from zero_jax.config._remat import NAMED_POLICIES

_GIB = 2 ** 30
_STAGE_NAMES = {
    0: "plain data parallelism, everything replicated",
    1: "optimizer state sharded",
    2: "optimizer state and gradients sharded",
    3: "optimizer state, gradients and parameters sharded",
}
_SHAPE_ARGS = ("layers", "hidden", "seq_len", "micro_batch", "heads")
# The largest byte count an estimate may reach: no 64-bit device or host
# addresses more (16 EiB), so sizes beyond it are a slip, not a machine.
def _unit(psi: float) -> tuple[str, float]:
  """GiB for models whose plain-DP state (16Ψ bytes) reaches 1 GiB, else
  MiB, so that small models do not print as 0.000. (With model parallelism
  Ψ is one model rank's, Ψ/M.)"""
  return ("GiB", _GIB) if 16 * psi >= _GIB else ("MiB", 2.0**20)


def _data_devices(args: argparse.Namespace) -> int:
  """N, the ``data`` axis: devices / (replica x model parallel)."""
  return args.devices // (args.replica * args.model_parallel)


def _zero_comm(args: argparse.Namespace, stage: int) -> dict[str, Any]:
  """ZeRO's collectives per step on each device: those of one model rank's
  Ψ/M parameters over its N data-parallel peers (without model parallelism,
  ``estimate_comm`` of Ψ on all devices)."""
  mp = args.model_parallel
  return comm.estimate_comm(
      args.params if mp == 1 else args.params / mp, args.devices // mp,
      stage, compute_dtype=COMPUTE_DTYPES[args.compute_dtype],
      reduce_dtype=COMPUTE_DTYPES[args.reduce_dtype], replica=args.replica)


def _psi(x: float) -> str:
  return f"{x:.3g}Ψ"


def _count(x: float) -> str:
  """7.5e9 -> '7.5B'; small counts as they are."""
  for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
    if x >= scale:
      return f"{x / scale:.4g}{suffix}"
  return f"{x:.4g}"


def _analytic_report(args: argparse.Namespace, stage: int,
                     activations: float | None) -> list[str]:
  compute = COMPUTE_DTYPES[args.compute_dtype]
  k = memory.optimizer_state_bytes(args.optimizer, args.k)
  est = memory.estimate_memory(args.params, args.devices, stage,
                               optimizer=args.optimizer, k=args.k,
                               compute_dtype=compute, replica=args.replica,
                               model_parallel=args.model_parallel,
                               activations=activations,
                               offload_optimizer=args.offload_optimizer,
                               offload_params=(args.offload_params
                                               and stage == 3))
  n = _data_devices(args)
  # The paper: 16-bit params/grads and an fp32 master counted in K with
  # mixed precision; fp32 params/grads and the optimizer's own K without.
  b = 2 if compute else 4
  paper = memory.paper_estimate(args.params, n, stage, param_bytes=b,
                                grad_bytes=b, k=k + (4 if compute else 0),
                                model_parallel=args.model_parallel)
  unit = _unit(args.params / args.model_parallel)
  size = lambda x: f"{x / unit[1]:.3f}"
  act = "-" if activations is None else size(est.activations)
  rows = [("params", size(est.params), size(paper.params)),
          ("gradients", size(est.grads), size(paper.grads)),
          ("optimizer state", size(est.opt_state), size(paper.opt_state)),
          ("model states", size(est.model_states), size(paper.model_states)),
          ("activations", act, "-"),
          ("total", size(est.total), size(paper.model_states))]
  if est.host:
    rows.append(("host (offloaded)", size(est.host), "-"))
  if est.host_grads:
    rows.append(("host (gradients)", size(est.host_grads), "-"))
  mp = args.model_parallel
  title = f"stage {stage}: {_STAGE_NAMES[stage]}"
  if mp > 1:
    title += f" (model parallel M = {mp}, data N = {n})"
  lines = [title,
           f"  {unit[0] + ' per device':<18}{'zero_jax':>12}{'paper':>12}"]
  lines += [f"  {name:<18}{ours:>12}{theirs:>12}"
            for name, ours, theirs in rows]
  ops = _zero_comm(args, stage)
  in_psi = {kind: d["elements"] / args.params for kind, d in ops.items()}
  nbytes = comm.comm_volume({kind: d["bytes"] for kind, d in ops.items()})
  parts = " + ".join(f"{kind} {_psi(x)}" for kind, x in in_psi.items())
  what = ("communication per step" if mp == 1 else
          "communication per step (ZeRO's, over N; the model's own "
          "collectives not counted)")
  lines.append(f"  {what}: {parts}; volume "
               f"{_psi(comm.comm_volume(in_psi))} = {size(nbytes)} {unit[0]}")
  return lines


def _gib(x: float) -> str:
  return f"{x / _GIB:.3f}"


def _compiled_report(args: argparse.Namespace, stage: int,
                     gpt: Any) -> list[str]:
  # The mesh is gpu_mesh(target, devices, replica=R, model=M).
  mp = args.model_parallel
  _, c = gpt.compile_gpt(
      args.compile, args.devices, stage, layers=args.layers,
      hidden=args.hidden, heads=args.heads, vocab=args.vocab,
      seq_len=args.seq_len, micro_batch=args.micro_batch,
      compute_dtype=COMPUTE_DTYPES[args.compute_dtype], remat=args.remat,
      attention=args.attention, optimizer=args.optimizer,
      replica=args.replica, offload_optimizer=args.offload_optimizer,
      offload_params=args.offload_params and stage == 3, model=mp)
  m = c.memory
  ops = "; ".join(
      f"{kind} {dtype} x{d['count']} {_gib(d['bytes'])} GiB"
      for (kind, dtype), d in sorted(c.collectives.items())) or "none"
  mesh = (f" (data {_data_devices(args)} x model {mp})" if mp > 1 else "")
  return [f"  compiled for {args.devices} x {args.compile}{mesh}: peak "
          f"{_gib(m.peak)} GiB per device (argument {_gib(m.argument)} + "
          f"output {_gib(m.output)} + temp {_gib(m.temp)} - alias "
          f"{_gib(m.alias)}); host (pinned_host) {_gib(m.host)} GiB",
          f"  compiled collectives per step: {ops}"]


def _activations(args: argparse.Namespace) -> float | None:
  """The analytic activation bytes per device, or None (no shape given, or
  a remat policy the estimate does not know)."""
  if args.layers is None or args.remat not in ("full", "none"):
    return None
  return memory.estimate_activations(
      layers=args.layers, hidden=args.hidden, seq_len=args.seq_len,
      micro_batch=args.micro_batch, heads=args.heads,
      vocab=args.vocab or 0,
      bytes_per_element=2 if COMPUTE_DTYPES[args.compute_dtype] else 4,
      remat=args.remat)


def report(args: argparse.Namespace, gpt: Any = None) -> str:
  """The text ``main`` prints for parsed arguments (``gpt``: as
  ``main``'s, needed with ``--compile``)."""
  compute = COMPUTE_DTYPES[args.compute_dtype]
  k = memory.optimizer_state_bytes(args.optimizer, args.k)
  n = _data_devices(args)
  mp = args.model_parallel
  activations = _activations(args)
  opt = f"K = {k:g}" if args.k is not None else f"{args.optimizer}, K = {k:g}"
  precision = (f"{args.compute_dtype} compute, fp32 master" if compute else
               "fp32 training")
  paper = (f"2-byte params and gradients, K = {k + 4:g} (fp32 master "
           f"4 + optimizer {k:g}: the master counts as optimizer state)"
           if compute else f"4-byte params and gradients, K = {k:g}")
  lines = [
      f"Ψ = {_count(args.params)} parameters on {args.devices} devices "
      f"(model parallel M = {mp}, sharded over N = {n}, replica groups "
      f"R = {args.replica}); {opt} bytes/param; {precision}",
      f"paper (arXiv:1910.02054): {paper}", ""]
  if mp > 1:
    lines[-1:-1] = [
        f"model parallelism: each device holds the model states of Ψ/M = "
        f"{_count(args.params / mp)} parameters (its model rank's slice, "
        f"split ideally), which ZeRO shards over N = {n}; the paper's "
        "column is its formula for Ψ/M on N"]
  for stage in _stages(args):
    lines += _analytic_report(args, stage, activations)
    if args.compile is not None:
      lines += _compiled_report(args, stage, gpt)
    lines.append("")
  lines.append("zero_jax keeps no gradient buffer between steps; gradients "
               "are counted because they are live at the update.")
  if args.compile is not None:
    lines.append(f"compiled: zero_jax.models.GPT ({args.attention} "
                 f"attention, remat {args.remat}, {args.optimizer}), global "
                 f"batch {args.micro_batch * args.devices // mp} x "
                 f"{args.seq_len} "
                 f"tokens, for {args.compile} GPUs (compiled without them: "
                 "zero_jax.models.compile_gpt); peak = argument + output + "
                 "temp - alias.")
  if activations is None and args.layers is not None:
    lines.append(f"activations: no analytic estimate for remat="
                 f"{args.remat} (only full and none).")
  elif activations is None:
    lines.append("activations: pass --layers --hidden --seq-len "
                 "--micro-batch --heads (and --vocab) to estimate them.")
  else:
    lines.append("activations: Korthikanti et al. (arXiv:2205.05198) "
                 f"estimate, remat={args.remat}; a planning number.")
    if mp > 1:
      lines.append("activations: counted as without model parallelism, an "
                   "upper bound (tensor parallelism splits part of them).")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None, gpt: Any = None) -> int:
  """Runs the command line.

  Args:
    argv: arguments without the program name; None reads ``sys.argv``.
    gpt: what ``--compile`` builds and compiles: ``zero_jax.models`` (its
      ``gpt_shapes`` and ``compile_gpt``), as ``python -m zero_jax.estimate``
      passes it; None: ``--compile`` is refused.

  Returns:
    0. Bad arguments exit through ``argparse`` (SystemExit, status 2) with a
    message saying what is wrong.
  """
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.devices % args.replica:
    parser.error(f"--devices {args.devices} is not divisible by --replica "
                 f"{args.replica}: state is sharded over devices / replica "
                 "devices")
  group = args.replica * args.model_parallel
  if args.devices % group:
    parser.error(f"--devices {args.devices} is not divisible by --replica "
                 f"{args.replica} x --model-parallel {args.model_parallel} "
                 f"= {group}: each data-parallel rank is a group of "
                 "--model-parallel devices; choose a --model-parallel (and "
                 "--replica) whose product divides --devices")
  given = [a for a in _SHAPE_ARGS if getattr(args, a) is not None]
  if (given or args.vocab is not None) and len(given) < len(_SHAPE_ARGS):
    missing = [f"--{a.replace('_', '-')}" for a in _SHAPE_ARGS
               if getattr(args, a) is None]
    parser.error("the activation estimate needs all of --layers --hidden "
                 "--seq-len --micro-batch --heads; missing "
                 + " ".join(missing))
  if given and args.hidden % args.heads:
    parser.error(f"--hidden {args.hidden} is not divisible by --heads "
                 f"{args.heads}: each head takes hidden / heads of the "
                 "model's width; give a --heads that divides --hidden")
  _check_config(parser, args)
  if args.compile is not None:
    _check_compile(parser, args, gpt)
  elif args.params is None:
    parser.error("--params is required (or --compile TARGET with the "
                 "model's shape, which counts them)")
  _check_estimate(parser, args)
  print(report(args, gpt))
  return 0


def _stages(args: argparse.Namespace) -> list[int]:
  return list(range(4)) if args.stage == "all" else [int(args.stage)]


def _check_config(parser: argparse.ArgumentParser,
                  args: argparse.Namespace) -> None:
  """Rejects options that ``ZeroConfig`` would reject, naming the flags."""
  if args.offload_params and args.stage not in ("3", "all"):
    parser.error(
        f"--offload-params needs --stage 3 (got --stage {args.stage}): only "
        "stage 3 shards the parameters it streams per layer; at stages 1-2 "
        "use --offload-optimizer with --compute-dtype bf16 to offload the "
        "fp32 master (--stage all applies --offload-params to stage 3 only)")
  if args.compile is not None and args.remat in NAMED_POLICIES:
    parser.error(
        f"--remat {args.remat} needs checkpoint names (ZeroConfig."
        "remat_names), which the command line cannot give: use --remat "
        "full, none, dots_saveable, attention_saveable or "
        "dots_attention_saveable with --compile")
  for stage in _stages(args):
    try:
      ZeroConfig(
          stage=stage, compute_dtype=COMPUTE_DTYPES[args.compute_dtype],
          reduce_dtype=COMPUTE_DTYPES[args.reduce_dtype],
          remat=args.remat if args.compile is not None else "full",
          offload_optimizer="host" if args.offload_optimizer else None,
          offload_params=("host" if args.offload_params and stage == 3
                          else None))
    except ValueError as e:
      parser.error(f"these options give no valid ZeroConfig at stage "
                   f"{stage}: {e}")


def _check_estimate(parser: argparse.ArgumentParser,
                    args: argparse.Namespace) -> None:
  """Rejects sizes whose bytes overflow: not finite (1e308 parameters), or
  beyond what a 64-bit machine addresses (``MAX_BYTES``)."""
  shape = " ".join(f"--{a.replace('_', '-')} {getattr(args, a)}"
                   for a in (*_SHAPE_ARGS, "vocab")
                   if getattr(args, a) is not None)
  try:
    activations = _activations(args)
  except (ValueError, OverflowError) as e:
    parser.error(f"{shape}: {e}; check these sizes")
  if activations is not None and not activations < MAX_BYTES:
    parser.error(f"{shape} give {activations:.3g} bytes of activations per "
                 "device, more than a 64-bit machine addresses (2^64 bytes, "
                 "16 EiB): check these sizes")
  compute = COMPUTE_DTYPES[args.compute_dtype]
  k = memory.optimizer_state_bytes(args.optimizer, args.k)
  for stage in _stages(args):
    try:
      est = memory.estimate_memory(
          args.params, args.devices, stage, optimizer=args.optimizer,
          k=args.k, compute_dtype=compute, replica=args.replica,
          model_parallel=args.model_parallel,
          offload_optimizer=args.offload_optimizer,
          offload_params=args.offload_params and stage == 3)
      ops = _zero_comm(args, stage)
      b = 2 if compute else 4
      paper = memory.paper_estimate(
          args.params, _data_devices(args), stage, param_bytes=b,
          grad_bytes=b, k=k + (4 if compute else 0),
          model_parallel=args.model_parallel)
    except ValueError as e:
      parser.error(f"--params {args.params:g} with --k {k:g}: {e}")
    figures = {
        "memory per device": (est.model_states + (activations or 0) +
                              est.host + est.host_grads),
        "model states per device (the paper's)": paper.model_states,
        "communication per step": comm.comm_volume(
            {kind: d["bytes"] for kind, d in ops.items()})}
    what, most = max(figures.items(), key=lambda item: item[1])
    if not most < MAX_BYTES:
      parser.error(f"--params {args.params:g} with --k {k:g} gives "
                   f"{most:.3g} bytes of {what} at stage {stage}, more "
                   "than a 64-bit machine addresses (2^64 bytes, 16 EiB): "
                   "check --params (7.5e9, 1.3B, 125M)")


def _check_compile(parser: argparse.ArgumentParser, args: argparse.Namespace,
                   gpt: Any) -> None:
  """Validates ``--compile`` and fills ``args.params`` with the GPT's count."""
  if gpt is None:
    parser.error("--compile builds zero_jax.models' reference GPT: run "
                 "python -m zero_jax.estimate (or pass "
                 "zero_jax.analysis.main gpt=zero_jax.models)")
  if args.compile not in aot.TARGETS:
    parser.error(f"unknown --compile target {args.compile!r}; choose one of "
                 f"{', '.join(sorted(aot.TARGETS))}")
  if args.layers is None or args.vocab is None:
    parser.error("--compile builds the reference GPT: pass --layers "
                 "--hidden --heads --vocab --seq-len --micro-batch")
  if args.k is not None:
    parser.error("--compile trains a real optimizer: choose it with "
                 "--optimizer, not --k")
  try:
    aot.gpu_devices(args.compile, 1)
  except (ImportError, RuntimeError) as e:
    parser.error(str(e))
  _, shapes = gpt.gpt_shapes(layers=args.layers, hidden=args.hidden,
                             heads=args.heads, vocab=args.vocab,
                             seq_len=args.seq_len)
  psi = param_count(shapes)
  if args.params is not None and abs(args.params - psi) > 0.01 * psi:
    parser.error(f"--params {_count(args.params)} disagrees with the "
                 f"{_count(psi)} parameters of the GPT given by the shape; "
                 "leave --params out with --compile")
  args.params = psi
