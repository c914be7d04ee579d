"""What a zero_jax step costs beyond plain data parallelism, on CPU.

Runs, interleaved in one process on 8 simulated CPU devices, one train step
of the reference GPT (``zero_jax.models.GPT``, fp32, ``optax.adamw``) in six
ways:

- ``dp``: plain ``jax.jit`` data parallelism, the peer: parameters and
  optimizer state replicated, the batch split over ``data``, the gradient
  all-reduce left to the compiler, the state donated;
- ``fsdp``: a GSPMD FSDP step, MaxText-style: one ``jax.jit`` whose
  parameters and optimizer state are split over ``data`` as zero_jax's
  stage 3 splits them (``zero_jax.layout.Plan``), with the activations pinned
  to the batch sharding at every block boundary and on the logits;
- ``0`` to ``3``: ``zero_jax.Engine`` at each ZeRO stage, the same loss,
  optimizer and dtype, called as a script calls it (``engine.step``);
  ``0-jit`` and ``3-jit`` (on request) call the engine's jitted step
  without ``engine.step`` around it: the difference is what the Python
  wrapper costs.

Each round runs every variant ``--steps`` steps back to back (the order
rotates from round to round, so that no variant always follows the same
one) and records its time per step. It prints each round's times and their
ratio to ``dp``, then the median over rounds and the ratio of the medians.
The machine's other load moves all variants of a round alike; the ratios
are what to read.

The report also says what each compiled step holds beyond plain data
parallelism: its temporary bytes, the minor page faults per step (XLA:CPU
allocates the temp afresh on every execution; above 32 MiB it comes back
as new pages), and counts of the instructions that made the difference
before (a select of the whole state against the old one to skip a
non-finite step, which XLA:CPU turned into copies of the optimizer state;
the gradient norm read whole on every device).

::

  PYTHONPATH=. python experiments/cpu_overhead.py
  PYTHONPATH=. python experiments/cpu_overhead.py --rounds 20 \\
      --out experiments/results/cpu_overhead.md
"""

import argparse
import collections
import os
import re
import resource
import shlex
import statistics
import sys
import time

# CPU only: a GPU plugin installed beside jax must not be initialised.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import zero_jax as zj
from _report import emit  # experiments/_report.py, beside this script
from zero_jax.layout import DATA, Plan
from zero_jax.models import GPT, GPTConfig, make_loss_fn, pinned_gpt_loss

zj.simulate_cpu_devices(8)  # before anything lists devices

VARIANTS = ("dp", "fsdp", "0", "1", "2", "3", "0-jit", "3-jit")
DEFAULT = ("dp", "fsdp", "0", "1", "2", "3")
LABELS = {"dp": "plain jit DP", "fsdp": "GSPMD FSDP", "0": "zero_jax stage 0",
          "1": "zero_jax stage 1", "2": "zero_jax stage 2",
          "3": "zero_jax stage 3", "0-jit": "stage 0, jitted only",
          "3-jit": "stage 3, jitted only"}


def parse_args() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--d-model", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--vocab", type=int, default=256)
  p.add_argument("--seq-len", type=int, default=32)
  p.add_argument("--batch-size", type=int, default=16,
                 help="global batch (sequences), divisible by 8")
  p.add_argument("--rounds", type=int, default=15)
  p.add_argument("--steps", type=int, default=5,
                 help="steps per variant per round")
  p.add_argument("--warmup", type=int, default=3,
                 help="untimed steps per variant after compiling")
  p.add_argument("--variants", default=",".join(DEFAULT),
                 help=f"comma-separated subset of {','.join(VARIANTS)} "
                 "(dp is always run: the ratios are to it; N-jit calls "
                 "stage N's jitted step without engine.step around it, "
                 "to see what the Python wrapper costs)")
  p.add_argument("--out", default=None, metavar="PATH.md",
                 help="also write the table as markdown")
  return p.parse_args()


# Ops the table counts in each compiled step (static counts: a loop body's
# ops once): what a step does beyond plain data parallelism shows here.
COUNTED = ("all-reduce", "reduce", "select", "copy", "conditional", "fusion")
# An instruction: ``%name = SHAPE opcode(``, SHAPE an array or a tuple.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%\S+ = (.*)$")
_OPCODE = re.compile(r"(?:^|[\]\)}] )([a-z][a-z0-9-]*)\(")


def op_counts(hlo_text: str) -> collections.Counter:
  """How many instructions of each opcode the compiled HLO text holds."""
  counts = collections.Counter()
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    op = m and _OPCODE.search(m.group(1))
    if op:
      counts[op.group(1)] += 1
  return counts


# ---------------------------------------------------------------- variants


class Variant:
  """A step function and its state; ``run(k)`` takes k steps.

  ``temp`` is the compiled step's temporary bytes per device. XLA:CPU
  allocates them afresh for every execution: what the allocator gave back
  to the system since the last step comes back as new pages, which the
  step page-faults (``run`` counts them), and a temp above glibc's largest
  mmap threshold (32 MiB) is new pages on every step.
  """

  def __init__(self, step, state, batch, compiled,
               loss_of=lambda out: out[-1]):
    self._step, self._state, self._batch = step, state, batch
    self._loss_of = loss_of
    self.temp = compiled.memory_analysis().temp_size_in_bytes
    self.ops = op_counts(compiled.as_text())
    self.last_loss = None

  def run(self, k: int) -> int:
    """Takes ``k`` steps; returns the minor page faults they took."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    out = None
    for _ in range(k):
      out = self._step(self._state, self._batch)
      self._state = out[0]
    # Every variant ends the same way: its last state and loss on hand.
    jax.block_until_ready(out)
    self.last_loss = float(self._loss_of(out))
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def plain_step(loss_fn, tx, mesh, param_sh, opt_sh):
  """One ``jax.jit`` of value_and_grad + optax, state donated."""
  batch_sh = NamedSharding(mesh, P(DATA))
  scalar = NamedSharding(mesh, P())

  def step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return jax.jit(step, in_shardings=((param_sh, opt_sh),
                                     {"tokens": batch_sh}),
                 out_shardings=((param_sh, opt_sh), scalar),
                 donate_argnums=0)


def build(name: str, graphdef, params, tx, mesh, batch) -> Variant:
  """The variant ``name``, compiled and warm-started from ``params``."""
  if name in ("dp", "fsdp"):
    if name == "dp":
      loss_fn = make_loss_fn(graphdef)
      rep = NamedSharding(mesh, P())
      param_sh = jax.tree.map(lambda _: rep, params)
      opt_sh = jax.tree.map(lambda _: rep, jax.eval_shape(tx.init, params))
    else:
      loss_fn = pinned_gpt_loss(graphdef, mesh)
      # zero_jax's stage-3 split: the same dimension and threshold.
      minimum = zj.ZeroConfig().min_shard_elements
      param_sh = Plan(params, mesh, 3, minimum).shardings
      opt_sh = Plan(jax.eval_shape(tx.init, params), mesh, 3,
                    minimum).shardings
    placed = jax.device_put(params, param_sh)
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(placed)
    step = plain_step(loss_fn, tx, mesh, param_sh, opt_sh)
    batch = jax.device_put(batch, NamedSharding(mesh, P(DATA)))
    state = (placed, opt_state)
    return Variant(step, state, batch, step.lower(state, batch).compile())
  stage, _, raw = name.partition("-")
  engine = zj.Engine(make_loss_fn(graphdef), tx,
                     zj.ZeroConfig(stage=int(stage)), mesh)
  state = engine.init(params)
  batch = engine.shard_batch(batch)
  # (engine.step's jitted function returns (state, metrics, flag).)
  step = engine.step.jitted if raw else engine.step
  return Variant(step, state, batch, engine.step.lower(state, batch).compile(),
                 loss_of=lambda out: out[1]["loss"])


# ------------------------------------------------------------------- report


def table(names, variants, medians, rounds, faults, args,
          seconds) -> str:
  """The markdown report: times, ratios, and what each step compiled to."""
  dp = medians["dp"]
  lines = [
      "# zero_jax step time against plain data parallelism (CPU)",
      "",
      f"GPT d_model {args.d_model}, {args.layers} layers, {args.heads} "
      f"heads, vocab {args.vocab}, seq {args.seq_len}, global batch "
      f"{args.batch_size}; fp32, optax.adamw; 8 simulated CPU devices; jax "
      f"{jax.__version__}. {args.rounds} rounds of {args.steps} steps per "
      f"variant, interleaved in one process (order rotated each round); "
      f"{seconds:.0f} s.",
      "",
      "| variant | median ms/step | ratio to plain DP (of medians) | "
      "median of per-round ratios | min-max per-round ratio |",
      "|---|---|---|---|---|",
  ]
  for n in names:
    per_round = [r[n] / r["dp"] for r in rounds]
    lines.append(
        f"| {LABELS[n]} | {medians[n] * 1e3:.2f} | {medians[n] / dp:.3f} | "
        f"{statistics.median(per_round):.3f} | {min(per_round):.3f}-"
        f"{max(per_round):.3f} |")
  if "fsdp" in medians and "3" in medians:
    per_round = [r["3"] / r["fsdp"] for r in rounds]
    lines += ["", f"Stage 3 / GSPMD FSDP: {medians['3'] / medians['fsdp']:.3f}"
              f" (median of per-round ratios "
              f"{statistics.median(per_round):.3f})."]
  lines += ["", "What each step compiled to (per device; instructions counted "
            "once, loop bodies included once):", "",
            "| variant | temp MiB | page faults per step | " +
            " | ".join(COUNTED) + " |",
            "|---|---|---|" + "---|" * len(COUNTED)]
  for n in names:
    v = variants[n]
    lines.append(f"| {LABELS[n]} | {v.temp / 2**20:.1f} | "
                 f"{statistics.median(faults[n]):.0f} | " +
                 " | ".join(str(v.ops[op]) for op in COUNTED) + " |")
  lines += ["", "Command: `PYTHONPATH=. python experiments/cpu_overhead.py "
            + shlex.join(sys.argv[1:]) + "`", ""]
  return "\n".join(lines)


def main() -> None:
  args = parse_args()
  names = ["dp"] + [n for n in args.variants.split(",")
                    if n in VARIANTS and n != "dp"]
  unknown = set(args.variants.split(",")) - set(VARIANTS)
  if unknown:
    raise SystemExit(f"unknown variants {sorted(unknown)}: pick from "
                     f"{VARIANTS}")
  config = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len,
                     d_model=args.d_model, n_layers=args.layers,
                     n_heads=args.heads)
  graphdef, params = nnx.split(GPT(config, rngs=nnx.Rngs(0)), nnx.Param)
  params = jax.tree.map(np.asarray, params)
  tx = optax.adamw(1e-3)
  mesh = zj.make_mesh()
  tokens = np.random.default_rng(0).integers(
      0, args.vocab, (args.batch_size, args.seq_len + 1), dtype=np.int32)
  batch = {"tokens": tokens}

  t0 = time.perf_counter()
  variants = {}
  with jax.set_mesh(mesh):
    for n in names:
      t = time.perf_counter()
      v = build(n, graphdef, params, tx, mesh, batch)
      v.run(args.warmup)
      variants[n] = v
      print(f"built {LABELS[n]:<18} compile+warmup "
            f"{time.perf_counter() - t:5.1f} s, loss {v.last_loss:.4f}",
            flush=True)

    rounds, faults = [], {n: [] for n in names}
    header = "round " + " ".join(f"{n:>14}" for n in names)
    print(f"ms/step (ratio to dp), {args.steps} steps per variant per round")
    print(header, flush=True)
    for r in range(args.rounds):
      order = names[r % len(names):] + names[:r % len(names)]
      times = {}
      for n in order:
        t = time.perf_counter()
        faults[n].append(variants[n].run(args.steps) / args.steps)
        times[n] = (time.perf_counter() - t) / args.steps
      rounds.append(times)
      print(f"{r:5d} " + " ".join(
          f"{times[n] * 1e3:7.2f} ({times[n] / times['dp']:4.2f})"
          for n in names), flush=True)

  medians = {n: statistics.median(r[n] for r in rounds) for n in names}
  # Every variant trains the same model on the same batch from the same
  # start: their losses agree (a check that each runs what it claims).
  losses = {n: v.last_loss for n, v in variants.items()}
  print("final losses: " + ", ".join(f"{n} {l:.5f}" for n, l in
                                     losses.items()))
  text = table(names, variants, medians, rounds, faults, args,
               time.perf_counter() - t0)
  emit(text, args.out)


if __name__ == "__main__":
  main()
