"""Train a small byte-level GPT on the Python standard library with ZeRO.

The data is the source of the standard library's top-level modules, read
from the local Python install (no downloads), as bytes (vocabulary 256):
the running Python's, so the figures depend on its version (the header
says which). After training it reports the validation loss and a sample
(a prompt from the held-out text, continued at temperature
``SAMPLE_TEMPERATURE`` from a key of ``--seed``: the same every run), then
compiles the same train step at ZeRO stages 0-3 and compares each stage's
per-device train-state bytes with the paper's formula. On one device, where
every stage holds the whole state, it also prints that table for the step
compiled for 8 H100s (compile-only devices from ``zero_jax.analysis``: no
GPU needed), where the stages shard it.

On a machine without an accelerator, 8 CPU devices are simulated::

  PYTHONPATH=. python experiments/train_gpt.py
  PYTHONPATH=. python experiments/train_gpt.py --stage 1 --devices 4 --steps 50
  PYTHONPATH=. python experiments/train_gpt.py \
      --deepspeed-config experiments/ds_config.json --log-jsonl run.jsonl

With ``--checkpoint-dir`` it saves every ``--save-every`` steps (and on
SIGTERM, then exits), and resumes from the latest checkpoint when started
again, at any stage or device count. Several processes (one per host, or
``python -m zero_jax.launch --nproc 2 --devices-per-proc 4
experiments/train_gpt.py`` on one machine) each feed their slice of the
same global batch.

A DeepSpeed JSON config (``--deepspeed-config``) sets the ZeRO stage, the
precision and loss scaling, gradient accumulation and clipping, optimizer
offload and the batch size, as DeepSpeed would; ``--remat`` and the model
flags still apply.
"""

import argparse
import dataclasses
import glob
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import zero_jax as zj
from zero_jax import analysis
from zero_jax import metrics as zm
from zero_jax.analysis import (paper_model_state_bytes, param_count,
                             per_device_bytes)
from zero_jax.layout import DATA, MODEL
from zero_jax.models import GPT, GPTConfig, make_loss_fn

zj.simulate_cpu_devices(8)  # before anything lists devices

MAX_DATA_BYTES = 4 * 2**20
VAL_FRACTION = 0.05
# The sample's temperature: greedy decoding of a model this small repeats
# one byte (a line of underscores).
SAMPLE_TEMPERATURE = 0.8
SAMPLE_BYTES = 100


# Defaults by machine. cpu: the demo of the README (8 simulated devices, a
# 0.87M-parameter model, seconds). gpu: GPT-2 small's shape (86M
# parameters with the byte vocabulary), bf16, cuDNN attention (the GPT's
# default), the chunked loss and the fastest remat that fits.
PRESETS = {
    "cpu": dict(seq_len=64, d_model=128, layers=4, heads=4, batch_size=32,
                steps=200, lr=3e-3, remat="full", loss_chunk=None,
                compute_dtype=None),
    "gpu": dict(seq_len=1024, d_model=768, layers=12, heads=12,
                batch_size=16, steps=500, lr=6e-4, remat="auto",
                loss_chunk=1024, compute_dtype="bfloat16"),
}


# The flags a DeepSpeed config replaces (it sets these itself), by their
# argparse names; giving one with --deepspeed-config is an error.
DEEPSPEED_REPLACES = ("stage", "compute_dtype", "batch_size",
                      "grad_accum_steps", "clip_grad_norm",
                      "offload_optimizer", "quantized_weights",
                      "quantized_gradients")
# Defaults of flags whose default is None so that the demo can tell a flag
# given from one left out (to refuse contradictions).
DEFAULTS = dict(stage=3, grad_accum_steps=1, clip_grad_norm=1.0,
                save_every=100, keep=3, export_dtype="float32")


def flag(name: str) -> str:
  """The command-line spelling of an argparse destination."""
  return "--" + name.replace("_", "-")


def parse_args(argv=None) -> tuple[argparse.Namespace,
                                   argparse.ArgumentParser]:
  """The flags, checked against each other (nothing touches a device)."""
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--deepspeed-config", default=None, metavar="FILE",
                 help="a DeepSpeed JSON config; it replaces --stage, "
                 "--compute-dtype, --batch-size, --grad-accum-steps, "
                 "--clip-grad-norm and --offload-optimizer (giving one of "
                 "them too is an error)")
  p.add_argument("--stage", type=int, default=None, choices=(0, 1, 2, 3),
                 help="ZeRO stage (default 3)")
  p.add_argument("--replica", type=int, default=1,
                 help="replica groups: state sharded inside each group of "
                 "devices // replica devices, replicated across groups")
  p.add_argument("--model-parallel", type=int, default=1, metavar="M",
                 help="tensor parallelism: groups of M devices split the "
                 "GPT Megatron-style (its own specs); ZeRO shards over the "
                 "devices // (replica * M) data-parallel ranks")
  p.add_argument("--compute-dtype", default=None,
                 choices=("bfloat16", "float16", "float32"),
                 help="forward/backward and gathered params in this dtype "
                 "(fp32 master weights and optimizer state)")
  p.add_argument("--remat", default=None, choices=sorted(zj.REMAT_POLICIES))
  p.add_argument("--devices", type=int, default=None,
                 help="devices on the data axis (default: all visible)")
  p.add_argument("--steps", type=int, default=None)
  p.add_argument("--batch-size", type=int, default=None,
                 help="global batch size (sequences per step)")
  p.add_argument("--grad-accum-steps", type=int, default=None,
                 help="micro-batches per step (the global batch is split; "
                 "default 1)")
  p.add_argument("--clip-grad-norm", type=float, default=None,
                 help="clip to this global norm (0: no clipping; default 1)")
  p.add_argument("--offload-optimizer", default=None, choices=("host",),
                 help="keep the optimizer state in host memory")
  p.add_argument("--quantized-weights", action="store_true", default=None,
                 help="ZeRO++'s qwZ: int8 parameter gathers (stage 3)")
  p.add_argument("--quantized-gradients", action="store_true",
                 default=None,
                 help="ZeRO++'s qgZ: int8 gradient all-to-alls (stages 1-3)")
  p.add_argument("--loss-scope", default="global",
                 choices=("global", "per_device"),
                 help="what the loss means: one device's over the whole "
                 "batch (global, default) or the mean of each device's "
                 "(per_device, DeepSpeed's; qgZ needs it)")
  p.add_argument("--preset", default="auto", choices=("auto",) + tuple(
      PRESETS), help="model and run size (auto: gpu on a GPU, else cpu); "
      "the flags below override it")
  p.add_argument("--seq-len", type=int, default=None)
  p.add_argument("--d-model", type=int, default=None)
  p.add_argument("--layers", type=int, default=None)
  p.add_argument("--heads", type=int, default=None)
  p.add_argument("--loss-chunk", type=int, default=None,
                 help="tokens per chunk of the loss (GPTConfig.loss_chunk)")
  p.add_argument("--lr", type=float, default=None)
  p.add_argument("--optimizer", default="adamw", choices=("adamw",))
  p.add_argument("--log-every", type=int, default=10,
                 help="progress line every N steps (redrawn every step on "
                 "a terminal)")
  p.add_argument("--log-jsonl", default=None, metavar="PATH",
                 help="append every step's metrics to PATH as JSON lines")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--plot", default=None, metavar="PATH",
                 help="write a PNG of the memory table to PATH (needs "
                 "matplotlib: pip install -e \".[plot]\")")
  p.add_argument("--skip-memory-table", action="store_true",
                 help="after training, do not compile the step at stages "
                 "0-3 for the per-device memory table")
  p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                 help="save checkpoints to DIR (and on SIGTERM); resume "
                 "from its latest checkpoint if it has one")
  p.add_argument("--save-every", type=int, default=None, metavar="N",
                 help="save every N steps (default 100; needs "
                 "--checkpoint-dir)")
  p.add_argument("--keep", type=int, default=None,
                 help="checkpoints kept in --checkpoint-dir (default 3)")
  p.add_argument("--init-params", default=None, metavar="DIR",
                 help="start from a parameters-only checkpoint (from "
                 "--export-params or plain orbax), fresh optimizer")
  p.add_argument("--export-params", default=None, metavar="DIR",
                 help="after training, write the parameters as one plain "
                 "orbax checkpoint (loadable without zero_jax)")
  p.add_argument("--export-dtype", default=None,
                 choices=("float32", "bfloat16"),
                 help="dtype of --export-params (default float32)")
  args = p.parse_args(argv)
  check_flags(p, args)
  for key, value in DEFAULTS.items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  return args, p


def check_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Refuses flags that contradict each other (or that would silently do
  nothing) and a --plot that could not be drawn, before any work."""
  given = lambda name: getattr(args, name) is not None
  if args.deepspeed_config:
    for name in DEEPSPEED_REPLACES:
      if given(name):
        p.error(f"{flag(name)} contradicts --deepspeed-config, which sets "
                "it: set it in the DeepSpeed config, or drop "
                "--deepspeed-config")
  if args.plot and args.skip_memory_table:
    p.error("--plot draws the memory table, which --skip-memory-table "
            "skips: drop one of them")
  for name in ("save_every", "keep"):
    if given(name) and not args.checkpoint_dir:
      p.error(f"{flag(name)} needs --checkpoint-dir (nothing is saved "
              "without it)")
  if given("export_dtype") and not args.export_params:
    p.error("--export-dtype needs --export-params (nothing is exported "
            "without it)")
  if args.plot:
    try:
      import matplotlib  # pylint: disable=g-import-not-at-top,unused-import
    except ImportError:
      p.error("--plot needs matplotlib, which is not installed: "
              "pip install -e \".[plot]\" (or drop --plot)")


def apply_preset(args: argparse.Namespace) -> None:
  """Fills the flags left out from ``--preset`` (auto: gpu on a GPU). Call
  it after ``zj.distributed.initialize()``: "auto" lists the devices."""
  preset = args.preset
  if preset == "auto":
    preset = "gpu" if jax.default_backend() == "gpu" else "cpu"
  args.preset = preset
  for key, value in PRESETS[preset].items():
    if getattr(args, key) is None:
      setattr(args, key, value)
  if args.compute_dtype == "float32":
    args.compute_dtype = None


# --------------------------------------------------------------------- data


def stdlib_dir() -> str:
  """The running Python's standard library: the training text."""
  return os.path.dirname(os.__file__)


def load_stdlib_bytes(max_bytes: int = MAX_DATA_BYTES) -> np.ndarray:
  """The standard library's top-level ``.py`` files, concatenated, as uint8."""
  libdir = stdlib_dir()
  chunks, total = [], 0
  for path in sorted(glob.glob(os.path.join(libdir, "*.py"))):
    with open(path, "rb") as f:
      chunk = f.read()
    chunks.append(chunk[:max_bytes - total])
    total += len(chunks[-1])
    if total >= max_bytes:
      break
  if total == 0:
    raise FileNotFoundError(f"no .py files found in {libdir}")
  return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def get_batch(data: np.ndarray, batch_size: int, seq_len: int,
              rng: np.random.Generator) -> dict[str, np.ndarray]:
  """Random windows of ``seq_len + 1`` bytes (inputs plus shifted targets).

  Every process draws the same global batch (same seed) and feeds its own
  rows of it (``zj.distributed.local_batch``).
  """
  starts = rng.integers(0, len(data) - seq_len - 1, size=batch_size)
  tokens = data[starts[:, None] + np.arange(seq_len + 1)]
  return {"tokens": tokens.astype(np.int32)}


# -------------------------------------------------------------- optimizer


def decay_mask(params):
  """Weight decay on weight matrices and embeddings only, as in nanoGPT:
  not on biases or LayerNorm scales (their names end in _bias / _scale)."""

  def is_matrix(path, _):
    name = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)][-1]
    return not name.endswith(("_bias", "_scale"))

  return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_optimizer(args):
  """AdamW with warmup and cosine decay. ``inject_hyperparams`` keeps the
  rate in the optimizer state, where the engine reads the ``learning_rate``
  metric.

  Clipping is the engine's (``ZeroConfig.clip_grad_norm``), so the pre-clip
  norm is reported.
  """
  warmup = max(1, min(100, args.steps // 10))
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=args.lr, warmup_steps=warmup,
      decay_steps=max(args.steps, warmup + 1), end_value=args.lr / 10)
  # (mask is a function, not a schedule: static.)
  return optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
      learning_rate=schedule, b1=0.9, b2=0.95, weight_decay=0.1,
      mask=decay_mask)


def used_flags(args, zero_config: zj.ZeroConfig, engine: zj.Engine,
               batch_size: int) -> dict:
  """The flags as the run uses them: those a DeepSpeed config sets (its
  stage, precision, batch, accumulation, clipping, offload) as set."""
  used = dict(stage=zero_config.stage,
              compute_dtype=zero_config.compute_dtype, batch_size=batch_size,
              grad_accum_steps=engine.grad_accum_steps,
              clip_grad_norm=zero_config.clip_grad_norm,
              offload_optimizer=zero_config.offload_optimizer,
              quantized_weights=zero_config.quantized_weights,
              quantized_gradients=zero_config.quantized_gradients)
  assert set(used) == set(DEEPSPEED_REPLACES)  # (each, as used)
  return dict(vars(args), **used)


def make_zero_config(args) -> zj.ZeroConfig:
  """From ``--deepspeed-config`` if given, else from the flags."""
  # The named remat policies act on the activations the GPT tags.
  remat = dict(remat=args.remat, remat_names=(
      ("attn_output", "mlp_hidden")
      if args.remat in ("save_only_named", "offload_to_host") else ()))
  if args.deepspeed_config:
    config = zj.from_deepspeed(args.deepspeed_config,
                               loss_scope=args.loss_scope)
    return dataclasses.replace(config, **remat)
  return zj.ZeroConfig(stage=args.stage, compute_dtype=args.compute_dtype,
                       grad_accum_steps=args.grad_accum_steps,
                       clip_grad_norm=args.clip_grad_norm or None,
                       offload_optimizer=args.offload_optimizer,
                       quantized_weights=bool(args.quantized_weights),
                       quantized_gradients=bool(args.quantized_gradients),
                       loss_scope=args.loss_scope, **remat)


# ------------------------------------------------------------ memory table


def mib(n: float) -> str:
  return f"{n / 2**20:.2f}"


MEMORY_NOTE = (
    "state (measured) = compiled argument bytes (device + host) - batch "
    "bytes; "
    "state (estimate) = zero_jax.estimate_memory (params + optimizer "
    "state).\n"
    "paper = the paper's formula (fp32: 4Ψ params + 4Ψ grads + 8Ψ Adam; "
    "with a compute dtype: 2Ψ + 2Ψ + 12Ψ) split per stage; "
    "gradients are step temporaries here, so they show up in temp, not "
    "in the state.")


# XLA's CPU code generation turned down for the tables' compiles: they are
# never run, and these passes act after buffer assignment, so the bytes are
# the same (tests/conftest.py compiles the suite so) in half the time.
CPU_TABLE_COMPILE = {"xla_backend_optimization_level": 0,
                     "xla_llvm_disable_expensive_passes": True}


def compiled_step_memory(engine, shapes, batch):
  """The compiled memory of ``engine``'s step for parameter ``shapes`` and
  ``batch`` (``zero_jax.analysis.compile_step``'s, on a CPU mesh with
  ``CPU_TABLE_COMPILE``)."""
  if engine.mesh.devices.flat[0].platform != "cpu":
    return analysis.compile_step(engine, shapes, batch).memory
  state = engine.abstract_state(shapes)
  with jax.set_mesh(engine.mesh):
    lowered = engine.step.lower(state, analysis.abstract_batch(engine, batch))
    return analysis.compiled_memory(lowered.compile(CPU_TABLE_COMPILE))


def memory_table(loss_fn, tx, params, batch, mesh, config, title,
                 plot_path=None, say=print) -> None:
  """Compiles the step at every stage on ``mesh`` from the shapes of
  ``params`` and ``batch`` (any mesh, real or compile-only devices) and
  prints per-device memory, saying each compile as it goes."""
  n = mesh.shape[DATA]
  m = dict(mesh.shape).get(MODEL, 1)
  psi = param_count(params)
  shapes = jax.eval_shape(lambda p: p, params)  # nothing is placed
  rows = []
  say(f"\nmemory table of the {title}: compiling the step at stages 0-3",
      flush=True)
  for stage in range(4):
    t0 = time.perf_counter()
    # (ZeRO++'s quantized collectives where the stage has them.)
    engine = zj.Engine(loss_fn, tx, dataclasses.replace(
        config, stage=stage,
        quantized_weights=config.quantized_weights and stage == 3,
        quantized_gradients=config.quantized_gradients and stage > 0), mesh)
    mem = compiled_step_memory(engine, shapes, batch)
    say(f"  stage {stage} compiled ({time.perf_counter() - t0:.1f}s)",
        flush=True)
    # Less the batch's bytes on one device (as the step lays it out); plus
    # offloaded state, which GPUs keep in host memory, outside `argument`.
    batch_bytes = per_device_bytes(analysis.abstract_batch(engine, batch))
    measured = mem.argument + mem.host - batch_bytes
    # The paper's mixed-precision formula (2-byte params and grads, K = 12)
    # with a compute dtype, its fp32 form (4, 4, K = 8) without.
    low = config.compute_dtype is not None
    paper = paper_model_state_bytes(psi, n, stage, param_bytes=2 if low else 4,
                                    grad_bytes=2 if low else 4,
                                    k=12 if low else 8, model_parallel=m)
    # zero_jax's analytic model of its own layouts, told which leaves stay
    # replicated (small or indivisible).
    est = zj.estimate_memory(
        psi, mesh.size, stage, optimizer="adamw",
        compute_dtype=config.compute_dtype, replica=mesh.size // (n * m),
        model_parallel=m,
        # (per model rank: a leaf split over 'model' holds 1/m there; the
        # estimate splits Ψ evenly over the ranks, which caps the count)
        replicated=min(psi / m, sum(
            int(np.prod(lp.shape)) // (m if lp.model_split else 1)
            for _, lp in engine.param_plan.rows() if not lp.sharded)))
    rows.append((stage, measured, est.persistent, paper, mem.temp, mem.peak))

  print(f"\nPer-device memory of the {title}, Ψ = {psi:,} parameters, "
        f"N = {n} devices (MiB)")
  head = (f"{'stage':>5} | {'Ψ':>9} | {'state (measured)':>16} | "
          f"{'state (estimate)':>16} | {'paper':>10} | {'ratio':>5} | "
          f"{'temp':>7} | {'peak':>7}")
  print(head)
  print("-" * len(head))
  for stage, measured, estimate, paper, temp, peak in rows:
    print(f"{stage:>5} | {psi:>9,} | {mib(measured):>16} | {mib(estimate):>16} "
          f"| {mib(paper):>10} | {measured / paper:>5.2f} | {mib(temp):>7} | "
          f"{mib(peak):>7}")

  if plot_path:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    stages = np.arange(4)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(stages - 0.3, [r[1] / 2**20 for r in rows], 0.3,
           label="train state (measured)")
    ax.bar(stages, [r[3] / 2**20 for r in rows], 0.3,
           label="paper formula (fp32, incl. grads)")
    ax.bar(stages + 0.3, [r[5] / 2**20 for r in rows], 0.3,
           label="peak (compiled)")
    ax.set_xticks(stages)
    ax.set_xlabel("ZeRO stage")
    ax.set_ylabel("MiB per device")
    ax.set_title(f"Ψ = {psi:,}, N = {n}")
    # Below the axes: the peak bars fill the plot area.
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15),
              ncol=3)
    fig.tight_layout()
    fig.savefig(plot_path, dpi=120)
    print(f"wrote {plot_path}")


# --------------------------------------------------------------------- main


def main() -> None:
  args, parser = parse_args()
  # Several processes (zero_jax.launch, SLURM, ...): join them; one plain
  # process: nothing to do. Before anything touches the devices (the
  # preset "auto" lists them).
  zj.distributed.initialize()
  apply_preset(args)
  if args.plot and jax.process_count() > 1:
    parser.error("--plot draws the memory table, which is compiled in one "
                 "process only: run without the launcher, or drop --plot")
  say = print if zj.distributed.is_main_process() else lambda *a, **k: None
  t_start = time.perf_counter()
  mesh = zj.make_mesh(num_devices=args.devices, replica=args.replica,
                      model=args.model_parallel)
  n = mesh.size
  n_batch = n // args.model_parallel  # (the batch is split over replica x data)

  data = load_stdlib_bytes()
  split = int(len(data) * (1 - VAL_FRACTION))
  train_data, val_data = data[:split], data[split:]
  np_rng = np.random.default_rng(args.seed)

  config = GPTConfig(seq_len=args.seq_len, d_model=args.d_model,
                     n_layers=args.layers, n_heads=args.heads,
                     loss_chunk=args.loss_chunk)
  model = GPT(config, rngs=nnx.Rngs(args.seed))
  graphdef, params = nnx.split(model, nnx.Param)
  loss_fn = make_loss_fn(graphdef)
  tx = make_optimizer(args)
  zero_config = make_zero_config(args)
  engine = zj.Engine(loss_fn, tx, zero_config, mesh)
  ckpt = (zj.Checkpointer(args.checkpoint_dir, max_to_keep=args.keep)
          if args.checkpoint_dir else None)
  if ckpt is not None and ckpt.latest_step() is not None:
    # Any stage, device count or offload: each device reads its own shards.
    state = ckpt.restore(engine, params)
    say(f"resumed from step {int(state.step)} of {args.checkpoint_dir}")
  elif args.init_params:
    state = engine.init(zj.load_params(args.init_params, engine, params))
    say(f"parameters from {args.init_params}, fresh optimizer state")
  else:
    state = engine.init(params)
  first = int(state.step) + 1
  # A DeepSpeed config fixes the global batch; else --batch-size does.
  batch_size = engine.train_batch_size or args.batch_size

  say(f"devices: {n} x {jax.devices()[0].platform} "
        f"({jax.devices()[0].device_kind})")
  say(f"data: {len(train_data):,} train / {len(val_data):,} val bytes of "
      f"the Python {sys.version.split()[0]} standard library's source "
      f"({stdlib_dir()}; another Python version gives other figures)")
  say(f"model: {config}, {param_count(params):,} parameters")
  say(f"run: {used_flags(args, zero_config, engine, batch_size)}")
  say(f"zero config: {zero_config}")
  say(f"global batch {batch_size} = {engine.grad_accum_steps} "
        f"micro-batch(es) x {n_batch} data-parallel rank(s) x "
        f"{batch_size // (engine.grad_accum_steps * n_batch)} sequences\n")
  say(engine.describe(), "\n")

  # ---------------------------------------------------------------- train
  n_params = param_count(params)
  # MFU where the device's peak is known (not on CPU).
  meter = zm.Throughput(
      batch_size * args.seq_len,
      flops_per_token=zm.transformer_flops_per_token(
          n_params, args.layers, args.seq_len, args.d_model),
      peak=zm.peak_flops(), num_devices=n)
  log = (zm.JsonlLogger(args.log_jsonl)
         if args.log_jsonl and zj.distributed.is_main_process() else None)
  t_train = time.perf_counter()
  with zm.ProgressBar(args.steps, every=args.log_every,
                      stream=sys.stdout if zj.distributed.is_main_process()
                      else open(os.devnull, "w")) as bar:
    for step in range(first, args.steps + 1):
      # One generator per step: a resumed run sees the data it would have.
      batch = get_batch(train_data, batch_size, args.seq_len,
                        np.random.default_rng([args.seed, step]))
      state, metrics = engine.step(state,
                                   zj.distributed.local_batch(batch, mesh))
      # Waiting for each step makes tokens/s exact; the first step compiles
      # and is left out of it.
      jax.block_until_ready(metrics)
      meter.update()
      if step == first:
        say(f"step {step} loss {float(metrics['loss']):.4f} (compile + "
            f"first step {time.perf_counter() - t_train:.1f}s)")
        if engine.remat_reason:
          say(engine.remat_reason)
      shown = {k: metrics[k] for k in ("loss", "grad_norm", "learning_rate",
                                       "loss_scale", "skipped_steps")
               if k in metrics}
      shown.update(meter.rates())
      bar.update(step, **shown)
      if log is not None:
        log.log(step, **metrics, **meter.rates())
      if step % args.log_every == 0:
        meter.window()
      if ckpt is not None:
        preempted = ckpt.reached_preemption(step)
        if step % args.save_every == 0 or step == args.steps or preempted:
          ckpt.save(state, engine=engine)  # async: training goes on
        if preempted:
          ckpt.close()  # waits for the save
          say(f"\nSIGTERM: saved step {step} to {args.checkpoint_dir}; "
                "exiting (start again to resume)")
          sys.exit(128 + signal.SIGTERM)
  if log is not None:
    log.close()
  if ckpt is not None:
    ckpt.close()
  if args.export_params:
    zj.export_params(engine, state, args.export_params,
                     dtype=jnp.dtype(args.export_dtype))
    say(f"exported the parameters ({args.export_dtype}) to "
          f"{args.export_params}")
  if meter.tokens_per_second:
    mfu = f", MFU {100 * meter.mfu:.1f}%" if meter.mfu is not None else ""
    say(f"throughput {meter.tokens_per_second:,.0f} tok/s over steps "
          f"{first + 1}-{args.steps}{mfu}")

  # ------------------------------------------------------------- evaluate
  full = engine.gather_params(state)
  eval_loss = jax.jit(loss_fn)
  val_rng = np.random.default_rng(args.seed + 1)
  val_losses = [
      float(eval_loss(full, engine.shard_batch(zj.distributed.local_batch(
          get_batch(val_data, batch_size, args.seq_len, val_rng), mesh))))
      for _ in range(8)
  ]
  say(f"\nvalidation loss {np.mean(val_losses):.4f} "
        f"({8 * batch_size} held-out windows)")

  # Sample: slide a seq_len window over a buffer, one jit for all; each
  # byte drawn at SAMPLE_TEMPERATURE from a key of the seed (deterministic).
  n_new = SAMPLE_BYTES

  @jax.jit
  def generate(params, prompt, key):
    model = nnx.merge(graphdef, params)
    buf = jnp.concatenate([prompt, jnp.zeros((n_new,), prompt.dtype)])

    def body(i, buf):
      window = jax.lax.dynamic_slice(buf, (i,), (args.seq_len,))
      logits = model(window[None])[0, -1].astype(jnp.float32)
      next_token = jax.random.categorical(jax.random.fold_in(key, i),
                                          logits / SAMPLE_TEMPERATURE)
      return buf.at[i + args.seq_len].set(next_token.astype(buf.dtype))

    return jax.lax.fori_loop(0, n_new, body, buf)

  # One device is plenty for a batch of one.
  one = jax.tree.map(lambda x: x.addressable_data(0), full)
  # Start the prompt at a line boundary so the sample is easier to read.
  start = int(np.argmax(val_data == ord("\n"))) + 1
  prompt = val_data[start:start + args.seq_len].astype(np.int32)
  key = jax.device_put(jax.random.key(args.seed),
                       jax.tree.leaves(one)[0].sharding)
  out = np.asarray(generate(one, prompt, key)).astype(np.uint8).tobytes()
  text = lambda b: b.decode("utf-8", errors="replace")
  say(f"sample (prompt from the held-out text, then >>> the model's "
      f"continuation, sampled at temperature {SAMPLE_TEMPERATURE} with "
      f"key {args.seed}):\n"
      f"{text(out[:args.seq_len])}>>>{text(out[args.seq_len:])}\n")
  del one, full
  for x in jax.tree.leaves(state):
    x.delete()
  say(f"training done in {time.perf_counter() - t_start:.1f}s")

  # ---------------------------------------------------------- memory table
  if jax.process_count() > 1:
    say("(the memory table compiles every stage in one process: run it "
        "without the launcher)")
  elif not args.skip_memory_table:
    batch = get_batch(train_data, batch_size, args.seq_len, np_rng)
    # The global batch stays fixed; the per-device batch follows the mesh.
    table_config = dataclasses.replace(
        zero_config, train_batch_size=batch_size, micro_batch_size=None,
        grad_accum_steps=engine.grad_accum_steps)
    memory_table(loss_fn, tx, params, batch, mesh, table_config,
                 "compiled train step", args.plot, say)
    # On one device every stage holds everything: compile the same step for
    # 8 GPUs (compile-only devices, no GPU needed) to see ZeRO shard it.
    if n == 1 and batch_size % (8 * engine.grad_accum_steps):
      say(f"(8 x H100 table skipped: the global batch {batch_size} does not "
          f"split into 8 devices x {engine.grad_accum_steps} micro-batch(es))")
    elif n == 1:
      try:
        h100 = analysis.gpu_mesh("h100", 8)
      except ImportError as e:
        say(f"(8 x H100 table skipped: {e})")
      else:
        memory_table(loss_fn, tx, params, batch, h100, table_config,
                     "train step compiled for 8 x H100 (compile-only: "
                     "zero_jax.analysis)", say=say)
    say(MEMORY_NOTE)
  say(f"\ntotal {time.perf_counter() - t_start:.1f}s")


if __name__ == "__main__":
  main()
