"""Where a step with the update on the host spends its time, on CPU.

On one H100 (issue 43) GPT-1.3B took 40.1x the step without offload with
``update_on="host"`` and the XLA:CPU program, where the program's own
benchmark on that host predicted about 6x. This profiles the same kind of
step where no GPU is lent: the reference GPT on one CPU device (the
"accelerator"), the host's update on the others, in one process, for

- ``none``: stage 3 without offload (the device's update);
- ``xla``: ``update_on="host"`` with ``optax.adamw``, the XLA:CPU program
  on the host's CPU devices (the H100's 40x mode);
- ``fused``: the same with ``zero_jax.offload.adamw``, the fused host
  optimizer (each leaf's compute copy sent as it is written);
- ``delayed``: ``fused`` with ``delay_update``.

Each mode's step is timed end to end (median after a warm-up step), and the
host's side is split into phases: for ``xla`` by timing the updater's
``update`` and ``to_device`` calls to completion (which serializes what
would overlap: on CPU nothing does, the device and the host share the
cores), for the fused modes from the updater's own phase times
(``FusedUpdate.seconds``). The rest of the step is the device's program
(forward and backward) and Python. Also: minor page faults per step (a
fresh host buffer costs one per 4 KiB), and the XLA:CPU program's rate on
one flat leaf of the same size outside the step, which is what the H100's
prediction used.

On CPU the transfers are memory copies, not PCIe: the bytes per step that
cross PCIe on a GPU are what ``engine.describe()`` states.

::

  PYTHONPATH=. python experiments/host_step_profile.py
  PYTHONPATH=. python experiments/host_step_profile.py --out \\
      experiments/results/host_step_profile_cpu.md
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

CPU_DEVICES = 3  # (one for the "accelerator", the rest for the host)


def _faults() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--d-model", type=int, default=768)
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--heads", type=int, default=12)
  ap.add_argument("--vocab", type=int, default=50304)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--seq", type=int, default=128)
  ap.add_argument("--steps", type=int, default=4)
  ap.add_argument("--modes", default="none,xla,fused,delayed")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  # pylint: disable=g-import-not-at-top
  import jax
  jax.config.update("jax_num_cpu_devices", CPU_DEVICES)
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx

  import zero_jax as zj
  from zero_jax.analysis import param_count
  from zero_jax.models import GPT, GPTConfig, make_loss_fn
  from zero_jax.offload import HostUpdate
  # pylint: enable=g-import-not-at-top

  cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq,
                  d_model=args.d_model, n_layers=args.layers,
                  n_heads=args.heads)
  graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  params = jax.tree.map(np.asarray, params)
  n = param_count(params)
  loss_fn = make_loss_fn(graphdef)
  batch = {"tokens": np.random.default_rng(0).integers(
      0, args.vocab, (args.batch, args.seq + 1), np.int32)}
  mesh = zj.make_mesh(num_devices=1)
  rows = {}
  for mode in args.modes.split(","):
    fused = mode in ("fused", "delayed")
    make = zj.offload.adamw if fused else optax.adamw
    host = {} if mode == "none" else {
        "offload_optimizer": "host", "update_on": "host",
        "delay_update": mode == "delayed"}
    engine = zj.Engine(loss_fn, make(1e-4, weight_decay=0.1), zj.ZeroConfig(
        stage=3, compute_dtype="bfloat16", **host), mesh)
    state = engine.init(params)
    phases: dict[str, list[float]] = {}
    updater = engine.layout.update.host if host else None
    def timed(name, call, wait_for_device=False):
      # An updater's call, timed to completion (and its page faults);
      # first, where asked, the device's program it takes the gradients of.
      def run(*a, **k):
        if wait_for_device:
          t = time.perf_counter()
          jax.block_until_ready(a[0])
          phases.setdefault("device program (forward, backward)",
                            []).append(time.perf_counter() - t)
        f, t = _faults(), time.perf_counter()
        out = call(*a, **k)
        if not fused:
          out = jax.block_until_ready(out)
        phases.setdefault(name, []).append(time.perf_counter() - t)
        phases.setdefault(f"page faults in {name}", []).append(_faults() - f)
        return out
      return run
    if host:
      updater.update = timed("host update" if fused else
                             "host update (gradients in, XLA:CPU program)",
                             updater.update, wait_for_device=True)
    if mode == "xla":
      updater.to_device = timed("compute copy to the device",
                                updater.to_device)
    sharded = engine.shard_batch(batch)
    times, faults = [], []
    for i in range(args.steps + 1):
      f, t = _faults(), time.perf_counter()
      state, metrics = engine.step(state, sharded)
      jax.block_until_ready(metrics["loss"])
      if host and fused:
        zj.offload.settle()
      times.append(time.perf_counter() - t)
      faults.append(_faults() - f)
      if fused and i:
        for name, s in updater.seconds.items():
          phases.setdefault(name, []).append(s)
      if i == 0:  # (the warm-up step's calls are not counted)
        phases.clear()
    rows[mode] = (statistics.median(times[1:]),
                  statistics.median(faults[1:]),
                  {k: statistics.median(v) for k, v in phases.items()})
    print(mode, rows[mode], flush=True)
    del state, engine

  # The XLA:CPU program alone on one flat leaf of n parameters: as the
  # H100's prediction measured it (the same fp32 gradients every call),
  # then as a step gives it (bf16 gradients from the step, new arrays every
  # call, put on the host's CPU devices by the update).
  shapes = {"w": jax.ShapeDtypeStruct((n,), np.float32)}
  alone = HostUpdate(optax.adamw(1e-4, weight_decay=0.1), shapes,
                     jax.devices()[1:])
  prepare = lambda g, extra: (g, None, None)
  isolated = {}
  for how in ("same fp32 gradients", "new bf16 gradients each call"):
    st = [alone.put({"w": np.ones(n, np.float32)}), None, None]
    st[1] = alone.init(st[0])
    fixed = alone.put({"w": np.full(n, 1e-3, np.float32)})
    times, faults = [], []
    for _ in range(args.steps + 1):
      grads = fixed if how.startswith("same") else {"w": jax.device_put(
          np.full(n, 1e-3, jnp.bfloat16), jax.devices()[0])}
      jax.block_until_ready(grads)
      f, t = _faults(), time.perf_counter()
      st[0], st[1], st[2], _ = alone.update(
          grads, st[0], st[1], {}, prepare=prepare,
          compute_dtype="bfloat16", into=st[2])
      jax.block_until_ready(st[2])
      times.append(time.perf_counter() - t)
      faults.append(_faults() - f)
    isolated[how] = (statistics.median(times[1:]),
                     statistics.median(faults[1:]))

  base = rows.get("none", (None,))[0]
  lines = [
      f"GPT d_model {args.d_model}, {args.layers} layers, vocabulary "
      f"{args.vocab} ({n / 1e6:,.1f}M parameters), batch {args.batch} x "
      f"{args.seq}, bf16 compute, AdamW, stage 3; one CPU device as the "
      f"accelerator, {CPU_DEVICES - 1} for the host's update; "
      f"{os.cpu_count()} cores; jax {jax.__version__}. Command: `PYTHONPATH=. "
      "python experiments/host_step_profile.py`", "",
      "| mode | step (s) | vs no offload | page faults / step | phases (s) |",
      "|---|---|---|---|---|"]
  for mode, (t, f, ph) in rows.items():
    ratio = "" if base is None else f"{t / base:.2f}x"
    detail = "; ".join(f"{k} {v:,.0f}" if k.startswith("page") else
                       f"{k} {v:.3f}" for k, v in ph.items())
    lines.append(f"| {mode} | {t:.3f} | {ratio} | {f:,.0f} | {detail} |")
  lines += ["", "Phases in seconds but page faults, medians; the fused "
            "host update's own phases are those inside its call.", "",
            f"The XLA:CPU program alone, one flat leaf of {n:,} parameters "
            f"on {CPU_DEVICES - 1} CPU devices:"]
  lines += [f"- {how}: {t:.3f} s ({n / t / 1e9:.2f} G params/s), "
            f"{f:,.0f} page faults" for how, (t, f) in isolated.items()]
  text = "\n".join(lines) + "\n"
  print(text)
  if args.out:
    with open(args.out, "w") as fh:
      fh.write(text)


if __name__ == "__main__":
  main()
