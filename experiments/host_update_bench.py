"""How fast the host updates fp32 AdamW state: XLA:CPU against torch.

ZeRO-Offload's split keeps the fp32 master and Adam moments in host memory
and updates them on the CPU, so the host's update rate bounds the step.
This measures the rate of one AdamW update (parameters per second, and per
core) over ``--params`` fp32 parameters:

- XLA:CPU: zero_jax's host update (``zero_jax.offload.HostUpdate``, the
  program ``update_on="host"`` runs: ``optax.adamw`` and the cast to the bf16
  compute copy), the state split over 1 CPU device and over one CPU device
  per core (each configuration in its own process: the device count is
  fixed when JAX starts);
- three candidates for a fused host optimizer, measured to see whether
  any closes the gap: AdamW written out by hand in XLA (every buffer
  donated, the same arithmetic as optax), the same cache-blocked (a loop
  over slices small enough for the cache, so that memory sees one pass
  where XLA:CPU otherwise makes four: it fuses no loop with several
  outputs), and numpy ufuncs with ``out=`` on cache-sized chunks, one
  chunk range per thread of a pool (numpy releases the GIL inside a
  ufunc);
- torch's fused CPU AdamW (``torch.optim.AdamW(fused=True)``) on all cores,
  the peer (torch is a benchmark-only dependency: skipped if missing).

::

  python experiments/host_update_bench.py
  python experiments/host_update_bench.py --params 268435456 --out h.md
"""

import argparse
import json
import os
import subprocess
import sys
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


_B1, _B2, _EPS, _LR, _WD = 0.9, 0.999, 1e-8, 1e-3, 0.1


def _donated_rate(fn, state: list, g, n: int, reps: int) -> float:
  """The rate of ``state = fn(*state, g, count)``, every state buffer
  donated, the last one (the copy) waited for."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  count = [0]

  def step():
    count[0] += 1
    state[:] = fn(*state, g, np.float32(count[0]))
    state[-1].block_until_ready()

  return _rate(step, n, reps)


def _xla_hand(n: int, devices: int, reps: int) -> float:
  """AdamW and the bf16 copy written out in jnp, every output donated."""
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count="
                             f"{devices}")
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  def update(p, mu, nu, copy, g, count):
    del copy  # (only its buffer)
    mu = _B1 * mu + (1 - _B1) * g
    nu = _B2 * nu + (1 - _B2) * g * g
    u = (mu / (1 - _B1 ** count)) / (
        jnp.sqrt(nu / (1 - _B2 ** count)) + _EPS) + _WD * p
    p = p - _LR * u
    return p, mu, nu, p.astype(jnp.bfloat16)

  sharding = NamedSharding(Mesh(np.array(jax.devices()), ("h",)), P("h"))
  put = lambda v, dtype=np.float32: jax.device_put(np.full(n, v, dtype),
                                                   sharding)
  state = [put(1.0), put(0.0), put(0.0), put(0.0, jnp.bfloat16)]
  g = put(1e-3)
  return _donated_rate(jax.jit(update, donate_argnums=(0, 1, 2, 3),
                               keep_unused=True), state, g, n, reps)


def _xla_chunked(n: int, devices: int, reps: int, chunk: int = 16384
                 ) -> float:
  """AdamW by hand in XLA, cache-blocked: a loop over ``chunk``-element
  slices of each device's block, each slice's new master and moments
  computed into one small stacked buffer and written in place (so that
  DRAM sees one pass), the bf16 copy carried as its bits (XLA:CPU widens a
  bf16 in-place update to a copy of the whole buffer)."""
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count="
                             f"{devices}")
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax import lax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  mesh = Mesh(np.array(jax.devices()), ("h",))

  def local(p, mu, nu, bits, g, count):
    def body(i, carry):
      p, mu, nu, bits = carry
      at = lambda a: lax.dynamic_slice_in_dim(a, i * chunk, chunk)
      m = _B1 * at(mu) + (1 - _B1) * at(g)
      v = _B2 * at(nu) + (1 - _B2) * at(g) * at(g)
      u = (m / (1 - _B1 ** count)) / (
          jnp.sqrt(v / (1 - _B2 ** count)) + _EPS) + _WD * at(p)
      # (One buffer for the three, kept whole by the barrier: XLA then
      # writes them in place; fused into each write, every iteration would
      # copy the whole arrays it reads slices of.)
      new = lax.optimization_barrier(jnp.stack([at(p) - _LR * u, m, v]))
      put = lambda a, x: lax.dynamic_update_slice_in_dim(a, x, i * chunk, 0)
      copy = lax.bitcast_convert_type(new[0].astype(jnp.bfloat16),
                                      jnp.uint16)
      return (put(p, new[0]), put(mu, new[1]), put(nu, new[2]),
              put(bits, copy))
    return lax.fori_loop(0, p.shape[0] // chunk, body, (p, mu, nu, bits))

  update = jax.shard_map(local, mesh=mesh, in_specs=(P("h"),) * 5 + (P(),),
                         out_specs=(P("h"),) * 4)
  sharding = NamedSharding(mesh, P("h"))
  put = lambda v, dtype=np.float32: jax.device_put(np.full(n, v, dtype),
                                                   sharding)
  state = [put(1.0), put(0.0), put(0.0), put(0, np.uint16)]
  g = put(1e-3)
  return _donated_rate(jax.jit(update, donate_argnums=(0, 1, 2, 3)), state,
                       g, n, reps)


def _numpy(n: int, threads: int, reps: int, chunk: int = 65536) -> float:
  """AdamW in numpy ufuncs with ``out=``, chunk by chunk, in place."""
  import concurrent.futures  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  p = np.ones(n, np.float32)
  mu, nu = np.zeros(n, np.float32), np.zeros(n, np.float32)
  g = np.full(n, 1e-3, np.float32)
  count = [0]

  def part(t: int, c1: float, c2: float) -> None:
    tmp, den = np.empty(chunk, np.float32), np.empty(chunk, np.float32)
    per = n // threads
    for lo in range(t * per, (t + 1) * per, chunk):
      hi = min(lo + chunk, (t + 1) * per)
      m, d = tmp[:hi - lo], den[:hi - lo]
      P, M, N, G = p[lo:hi], mu[lo:hi], nu[lo:hi], g[lo:hi]
      np.subtract(G, M, out=m)
      m *= 1 - _B1
      M += m
      np.multiply(G, G, out=m)
      m *= 1 - _B2
      N *= _B2
      N += m
      # (The bias corrections folded into two constants.)
      np.sqrt(N, out=d)
      d += _EPS * c2
      np.divide(M, d, out=m)
      m *= c1
      P *= 1 - _LR * _WD
      P -= m

  pool = concurrent.futures.ThreadPoolExecutor(threads)

  def step():
    count[0] += 1
    bc1, bc2 = 1 - _B1 ** count[0], 1 - _B2 ** count[0]
    c1, c2 = _LR * bc2 ** 0.5 / bc1, bc2 ** 0.5
    list(pool.map(lambda t: part(t, c1, c2), range(threads)))

  return _rate(step, n, reps)


def _torch(n: int, threads: int, reps: int) -> float | None:
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  torch.set_num_threads(threads)
  p = torch.ones(n)
  p.grad = torch.full((n,), 1e-3)
  opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, fused=True)
  return _rate(opt.step, n, reps)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--params", type=int, default=64 * 2 ** 20)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--out", default=os.path.join(
      os.path.dirname(os.path.abspath(__file__)), "results",
      "host_update_cpu.md"))
  ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    kind, count = args.worker.split(":")
    rate = {"xla": _xla, "hand": _xla_hand, "chunked": _xla_chunked,
            "numpy": _numpy,
            "torch": _torch}[kind](args.params, int(count), args.reps)
    print(json.dumps(rate))
    return
  cores = os.cpu_count()
  rows = []
  # (The workers import zero_jax from this checkout.)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      filter(None, [root, os.environ.get("PYTHONPATH")])))
  # Per core is over all the host's cores: one XLA:CPU device runs its
  # computation on the process's whole thread pool, not on one core.
  for name, worker, used in (
      ("zero_jax host update (XLA:CPU), 1 CPU device", "xla:1", cores),
      (f"zero_jax host update (XLA:CPU), {cores} CPU devices", f"xla:{cores}",
       cores),
      (f"AdamW by hand in XLA, {cores} CPU devices", f"hand:{cores}", cores),
      (f"the same, cache-blocked (16K-element slices), {cores} CPU devices",
       f"chunked:{cores}", cores),
      (f"numpy ufuncs on 64K chunks, {cores} threads", f"numpy:{cores}",
       cores),
      ("torch fused AdamW, 1 thread", "torch:1", 1),
      (f"torch fused AdamW, {cores} threads", f"torch:{cores}", cores)):
    out = subprocess.run([sys.executable, __file__, "--worker", worker,
                          "--params", str(args.params), "--reps",
                          str(args.reps)], capture_output=True, text=True,
                         check=True, env=env)
    rate = json.loads(out.stdout.strip().splitlines()[-1])
    rows.append((name, rate, used))
    print(name, "skipped (no torch)" if rate is None else
          f"{rate / 1e9:.3f} G params/s", flush=True)
  torch_rate = rows[-1][1]
  lines = [f"AdamW update of {args.params:,} fp32 parameters on a "
           f"{cores}-core host (`python experiments/host_update_bench.py "
           f"--reps {args.reps}`)",
           "", "| update | G params/s | per core | / torch |",
           "|---|---|---|---|"]
  for name, rate, used in rows:
    if rate is None:
      lines.append(f"| {name} | skipped: torch not installed | | |")
      continue
    ratio = "" if torch_rate is None else f"{rate / torch_rate:.2f}"
    lines.append(f"| {name} | {rate / 1e9:.3f} | {rate / used / 1e9:.3f} | "
                 f"{ratio} |")
  text = "\n".join(lines) + "\n"
  print(text)
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    f.write(text)


if __name__ == "__main__":
  main()
