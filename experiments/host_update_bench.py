"""How fast the host updates fp32 AdamW state: zero_jax's fused host
optimizer against torch's fused CPU AdamW and the memory's bandwidth.

ZeRO-Offload's split keeps the fp32 master and Adam moments in host memory
and updates them on the CPU, so the host's update rate bounds the step.
This measures, in one run, at 1, 2 and all cores, the rate of one AdamW
update over ``--params`` fp32 parameters
(parameters per second, per core, and GB/s at the bytes a parameter each
moves: 28 reading p, g, m, v and writing p, m, v; 30 with the bf16 copy):

- STREAM's triad, the memory bandwidth the update is bound by;
- torch's fused CPU AdamW (``torch.optim.AdamW(fused=True)``, a
  benchmark-only dependency: skipped if missing) and the fused kernel alone
  (``zero_jax.offload.kernels()``), like for like with torch (fp32
  gradients, no norm), then with the bf16 compute copy written in the same
  pass: the three take turns in one process, so that each turn's ratio
  sees the same memory bandwidth (a shared host's drifts by 2x);
- the shipped update (``FusedUpdate.update``, what ``update_on="host"``
  runs with ``zero_jax.offload.adamw``): bf16 gradients as the device
  sends them, their norm, the step's scalars, the update and the copy;
- the XLA:CPU program other optax chains run (``HostUpdate``), on one CPU
  device per core.

Each of those in a process of its own, ``--rounds`` times in turn; medians
are reported.

::

  python experiments/host_update_bench.py
  python experiments/host_update_bench.py --params 268435456 --out h.md
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def _rate(step, n: int, reps: int) -> float:
  step()  # compile / warm up
  t = time.perf_counter()
  for _ in range(reps):
    step()
  return n * reps / (time.perf_counter() - t)


def _xla(n: int, devices: int, reps: int) -> float:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count="
                             f"{devices}")
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  from zero_jax.offload import HostUpdate  # pylint: disable=g-import-not-at-top

  # The update_on="host" program itself: AdamW over the master split across
  # the CPU devices, and the new bf16 compute copy cast from it.
  shapes = {"w": jax.ShapeDtypeStruct((n,), jnp.float32)}
  host = HostUpdate(optax.adamw(1e-3, weight_decay=0.1), shapes,
                    jax.devices())
  master = host.put({"w": np.ones(n, np.float32)})
  state = [master, host.init(master), None]
  grads = host.put({"w": np.full(n, 1e-3, np.float32)})
  prepare = lambda g, extra: (g, None, None)

  def step():
    # (As the engine does: the copy the last update made, sent to the
    # device by now, gives its buffers to the next.)
    state[0], state[1], state[2], _ = host.update(
        grads, state[0], state[1], {}, prepare=prepare,
        compute_dtype=jnp.bfloat16, into=state[2])
    state[2]["w"].block_until_ready()

  return _rate(step, n, reps)


def _versus(n: int, threads: int, reps: int) -> dict[str, list[float]]:
  """torch's fused AdamW and the fused kernel alone, without and with the
  bf16 compute copy written in the same pass, in one process, one update
  of each in turn ``reps`` times: each rep's three rates see the same
  machine (its memory bandwidth drifts with the host's other load). Like
  for like with torch: fp32 gradients, no norm. No torch: the kernel's
  rows alone."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from zero_jax import offload  # pylint: disable=g-import-not-at-top

  k = offload.kernels()
  k.set_threads(threads)
  p, g = np.ones(n, np.float32), np.full(n, 1e-3, np.float32)
  m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
  # (The copy in a buffer aligned as the shipped update's are: the kernel
  # streams it past the cache only from 32-byte boundaries.)
  raw = np.empty(n + 16, ml_dtypes.bfloat16)
  start = -raw.ctypes.data % 32 // 2
  out = offload.as_kernel_array(raw[start:start + n])
  f = np.float32
  scalars = (f(1), f(1), f(1), f(-1e-3), f(0.9), f(0.999), f(1e-8), f(0),
             f(0.1), f(0.1), f(0.001), f(0))
  steps = {"kernel": lambda: k.adam(p, g, m, v, offload.NOTHING, *scalars),
           "copy": lambda: k.adam(p, g, m, v, out, *scalars)}
  try:
    import torch  # pylint: disable=g-import-not-at-top
    torch.set_num_threads(threads)
    tp = torch.ones(n)
    tp.grad = torch.full((n,), 1e-3)
    steps["torch"] = torch.optim.AdamW([tp], lr=1e-3, weight_decay=0.1,
                                       fused=True).step
  except ImportError:
    pass
  rates = {name: [] for name in steps}
  for step in steps.values():
    step()  # (compile, warm up)
  for _ in range(reps):
    for name, step in steps.items():
      t = time.perf_counter()
      step()
      rates[name].append(n / (time.perf_counter() - t))
  return rates


def _fused(n: int, threads: int, reps: int) -> float:
  """The shipped update (``FusedUpdate.update``, what update_on="host"
  runs with ``zero_jax.offload.adamw``): bf16 gradients as the device sends
  them, their norm, the step's scalars, AdamW and the bf16 compute copy."""
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from zero_jax import offload  # pylint: disable=g-import-not-at-top

  offload.kernels().set_threads(threads)
  shapes = {"w": jax.ShapeDtypeStruct((n,), jnp.float32)}
  tx = offload.adamw(1e-3, weight_decay=0.1)
  host = offload.FusedUpdate(tx, offload.rule_of(tx), shapes,
                             jax.devices("cpu")[0])
  state = list(host.init({"w": np.ones(n, np.float32)}))
  grads = {"w": np.full(n, 1e-3, ml_dtypes.bfloat16)}
  prepare = lambda sumsq, extra: ((jnp.float32(1), False, jnp.sqrt(sumsq),
                                   jnp.float32(1)), None, None)

  def step():
    state[0], state[1], _, _ = host.update(
        grads, state[0], state[1], {}, prepare=prepare,
        compute_dtype=jnp.bfloat16)

  return _rate(step, n, reps)


def _compile(n: int, threads: int, reps: int) -> float:
  """Seconds from importing the kernels to the end of their first AdamW
  update with the bf16 copy, the norm and the cast (numba compiles them,
  or loads them from its cache: ``NUMBA_CACHE_DIR``)."""
  del n, reps
  start = time.perf_counter()
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from zero_jax import offload  # pylint: disable=g-import-not-at-top

  k = offload.kernels()
  k.set_threads(threads)
  f = np.float32
  p, g, m, v = (np.ones(1024, np.float32) for _ in range(4))
  out = offload.as_kernel_array(np.empty(1024, ml_dtypes.bfloat16))
  k.adam(p, offload.as_kernel_array(g.astype(ml_dtypes.bfloat16)), m, v,
         out, f(1), f(1), f(1), f(-1e-3), f(0.9), f(0.999), f(1e-8),
         f(0), f(0.1), f(0.1), f(0.001), f(0))
  k.sumsq(out)
  k.cast(p, out)
  return time.perf_counter() - start


def _triad(n: int, threads: int, reps: int) -> float:
  """STREAM's triad (a = b + s * c, fp32) in numba: bytes per second."""
  import numba  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  numba.set_num_threads(threads)

  @numba.njit(parallel=True)
  def triad(a, b, c, s):
    for i in numba.prange(a.shape[0]):
      a[i] = b[i] + s * c[i]

  a, b, c = (np.ones(n, np.float32) for _ in range(3))
  return _rate(lambda: triad(a, b, c, np.float32(3)), n, reps) * 12


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--params", type=int, default=64 * 2 ** 20)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--rounds", type=int, default=3,
                  help="times the whole plan runs; medians are reported "
                  "(the host's other load drifts: each ratio is taken "
                  "within a round)")
  ap.add_argument("--out", default=os.path.join(
      os.path.dirname(os.path.abspath(__file__)), "results",
      "host_update_cpu.md"))
  ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    kind, count = args.worker.split(":")
    rate = {"xla": _xla, "fused": _fused, "triad": _triad,
            "compile": _compile, "versus": _versus
            }[kind](args.params, int(count), args.reps)
    print(json.dumps(rate))
    return
  cores = os.cpu_count()
  # (The workers import zero_jax from this checkout.)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      filter(None, [root, os.environ.get("PYTHONPATH")])))
  threads = sorted({1, 2, cores})
  workers = ([f"triad:{t}" for t in threads] +
             [w for t in threads for w in (f"versus:{t}", f"fused:{t}")] +
             [f"xla:{cores}"])
  # Per worker, its result in each round.
  got = {w: [] for w in workers}
  for r in range(args.rounds):
    for worker in workers:
      out = subprocess.run([sys.executable, __file__, "--worker", worker,
                            "--params", str(args.params), "--reps",
                            str(args.reps)], capture_output=True, text=True,
                           check=True, env=env)
      got[worker].append(json.loads(out.stdout.strip().splitlines()[-1]))
      print(f"round {r + 1}: {worker} {got[worker][-1]}", flush=True)
  # The kernels' first call: compiled into an empty cache, then loaded.
  cache = tempfile.mkdtemp()
  first = [json.loads(subprocess.run(
      [sys.executable, __file__, "--worker", f"compile:{cores}"],
      capture_output=True, text=True, check=True,
      env=dict(env, NUMBA_CACHE_DIR=cache)).stdout.strip().splitlines()[-1])
           for _ in range(2)]
  shutil.rmtree(cache, ignore_errors=True)
  print(f"first call: {first[0]:.1f} s compiling, {first[1]:.1f} s cached",
        flush=True)
  med = statistics.median
  lines = [f"AdamW update of {args.params:,} fp32 parameters on a "
           f"{cores}-core host (`python experiments/host_update_bench.py "
           f"--reps {args.reps} --rounds {args.rounds}`): medians; torch "
           "and the kernel alone take turns in one process, the ratio the "
           "median of each turn's; the other rows each in a process of its "
           "own, their ratio against the same round's torch",
           "", "| update | G params/s | per core | GB/s | / torch, same "
           "threads |", "|---|---|---|---|---|"]

  def row(name, rates, used, per, ratios):
    rate = med(rates)
    ratio = f"{med(ratios):.2f}" if ratios else ""
    lines.append(f"| {name} | {rate / 1e9:.3f} | {rate / used / 1e9:.3f} | "
                 f"{rate * per / 1e9:.1f} | {ratio} |")

  for t in threads:
    lines.append(f"| STREAM triad (numba), {t} thread(s) | | | "
                 f"{med(got[f'triad:{t}']) / 1e9:.2f} | |")
  for t in threads:
    turns = got[f"versus:{t}"]
    pool = lambda name: [x for turn in turns for x in turn.get(name, [])]
    torch_of = [med(turn["torch"]) if "torch" in turn else None
                for turn in turns]
    versus = lambda name: ([a / b for turn in turns for a, b in zip(
        turn[name], turn["torch"])] if None not in torch_of else [])
    if None in torch_of:
      lines.append(f"| torch fused AdamW, {t} thread(s) | skipped: torch "
                   "not installed | | | |")
    else:
      row(f"torch fused AdamW, {t} thread(s)", pool("torch"), t, 28, [])
    row(f"fused AdamW kernel, {t} thread(s)", pool("kernel"), t, 28,
        versus("kernel"))
    row(f"the same, bf16 copy in the pass, {t} thread(s)", pool("copy"), t,
        30, versus("copy"))
    shipped = got[f"fused:{t}"]
    row(f"shipped update (bf16 grads, norm, scalars, copy), {t} thread(s)",
        shipped, t, 30, [] if None in torch_of else
        [a / b for a, b in zip(shipped, torch_of)])
  # One XLA:CPU device runs its computation on the process's whole thread
  # pool: per core is over all the host's cores.
  torch_all = [med(turn["torch"]) for turn in got[f"versus:{cores}"]
               if "torch" in turn]
  row(f"XLA:CPU program (the fallback), {cores} CPU devices",
      got[f"xla:{cores}"], cores, 46,
      [a / b for a, b in zip(got[f"xla:{cores}"], torch_all)])
  lines += ["", f"The kernels' first call (import, AdamW with the bf16 "
            f"copy, the norm, the cast): {first[0]:.1f} s compiling into an "
            f"empty cache, {first[1]:.1f} s loading from numba's cache."]
  text = "\n".join(lines) + "\n"
  print(text)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    f.write(text)


if __name__ == "__main__":
  main()
