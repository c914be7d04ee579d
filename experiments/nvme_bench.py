"""How fast the NVMe tier moves its state: the raw sequential bandwidth of
the disk under ``--dir`` beside what ``NvmeUpdate`` achieves on it.

The tier (``offload_optimizer="nvme"``) keeps the fp32 master and Adam's
moments in files, 12 bytes a parameter, and reads and writes all of them
every step, so its step is bound by the disk. In one process, round by
round (the bandwidth of a shared machine's disk drifts between processes
and within one, so every ratio is taken within a round):

- raw: a file of ``--gib`` GiB written (then ``fsync``) and read with
  ``O_DIRECT`` in large aligned requests, each an ``os.pwritev`` or
  ``os.preadv``: from a pool of threads keeping each tier setting's
  ``in_flight`` (and twice as many) requests of its ``block_bytes`` in
  flight (as
  the tier's I/O threads do), and from one thread in 64 MiB
  requests. The best raw method of the round is the bar;
- the tier, for each ``--nvme`` setting: an ``NvmeUpdate`` whose files
  hold ``--gib`` GiB a version (AdamW: master, mu and nu), a few leaves
  of a few sizes; its write pass (``init``: every slice filled and
  written, the files flushed; ``adopt`` of a state with moments of random
  magnitudes, as a trained state's), its read pass (``verify``: every slice of
  every file read, its checksums checked) and a whole update
  (``update`` on bf16 gradients: every slice read, updated with the bf16
  copy written in the same pass, written, flushed). Each pass's bytes
  and seconds are the tier's own count (``NvmeUpdate.io``).

A warm-up round (not reported) writes every file once, so that the rounds
overwrite allocated blocks, as a run's steps do, and compiles the
kernels. Every file is deleted at the end. Medians over ``--rounds``.

::

  PYTHONPATH=. python experiments/nvme_bench.py --dir /tmp
  PYTHONPATH=. python experiments/nvme_bench.py --dir /mnt/nvme --gib 8 \\
      --nvme in_flight=8,block_bytes=8MiB --nvme in_flight=16
"""

import argparse
import concurrent.futures
import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time

from _report import emit  # experiments/_report.py, beside this script

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_MIB = 2**20
_UNITS = {"": 1, "k": 2**10, "kib": 2**10, "m": _MIB, "mib": _MIB,
          "g": 2**30, "gib": 2**30}
_SINGLE_BLOCK = 64 * _MIB  # (the single-thread raw method's requests)
_DIRECT = getattr(os, "O_DIRECT", 0)


def _bytes(text: str) -> int:
  match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
  if not match or match.group(2).lower() not in _UNITS:
    raise argparse.ArgumentTypeError(f"{text!r} is not a size (4096, 8MiB)")
  return int(match.group(1)) * _UNITS[match.group(2).lower()]


def _options(spec: str):
  """``NvmeOptions`` from ``name=value,...`` (sizes may say KiB, MiB,
  GiB; flags true or false), with ``resume=False``: every round's ``init``
  starts afresh over the last round's state."""
  import zero_jax as zj  # pylint: disable=g-import-not-at-top

  fields = {}
  for part in filter(None, (p.strip() for p in spec.split(","))):
    name, eq, value = part.partition("=")
    if not eq:
      raise argparse.ArgumentTypeError(f"{part!r}: expected name=value")
    low = value.strip().lower()
    fields[name.strip()] = (low == "true" if low in ("true", "false")
                            else _bytes(value))
  return zj.NvmeOptions.of({**fields, "resume": False})


def _mib(n: int) -> str:
  return f"{n / _MIB:g} MiB"


def _label(o) -> str:
  """A setting in words (the flags only where not the default's)."""
  text = (f"in_flight {o.in_flight}, block {_mib(o.block_bytes)}, slice "
          f"{_mib(o.slice_bytes)}, buffers {o.buffer_count}")
  for flag in ("read_ahead", "write_behind", "direct"):
    if not getattr(o, flag):
      text += f", {flag} off"
  return text


# ------------------------------------------------------------------- raw


class Raw:
  """One file of ``size`` bytes (a multiple of 4096), written and read in
  large aligned requests: ``threads`` at a time from a pool, each
  ``block`` bytes (the last may be shorter), like the tier's ``Pool``;
  ``threads`` 1: one request after another from this thread."""

  def __init__(self, path: str, size: int, methods: list[tuple[int, int]]):
    import mmap  # pylint: disable=g-import-not-at-top

    import numpy as np  # pylint: disable=g-import-not-at-top

    # (Anonymous maps start on a page: what O_DIRECT needs.)
    aligned = lambda n: np.frombuffer(mmap.mmap(-1, n), np.uint8)
    self.path, self.size = path, size
    flags = os.O_RDWR | os.O_CREAT
    try:
      self.fd = os.open(path, flags | _DIRECT, 0o600)
      self.direct = bool(_DIRECT)
    except OSError:  # (tmpfs: no O_DIRECT; said in the report)
      self.fd = os.open(path, flags, 0o600)
      self.direct = False
    os.ftruncate(self.fd, size)  # (sparse, as the tier's new files are)
    rng = np.random.default_rng(0)
    self.methods = {}
    for threads, block in methods:
      # Per thread two buffers in turn; what they hold is incompressible
      # (a virtual disk may store zeros as holes).
      ring = [aligned(block) for _ in range(
          1 if threads == 1 else 2 * threads)]
      for b in ring:
        b[...] = np.frombuffer(rng.bytes(block), np.uint8)
      pool = (None if threads == 1 else concurrent.futures.ThreadPoolExecutor(
          threads, thread_name_prefix="nvme-bench"))
      self.methods[(threads, block)] = (ring, pool)

  @staticmethod
  def name(threads: int, block: int) -> str:
    if threads == 1:
      return f"1 thread, {_mib(block)} requests"
    return f"{threads} in flight, {_mib(block)} requests"

  def _request(self, write: bool, buf, offset: int) -> None:
    view = memoryview(buf)
    n = (os.pwritev if write else os.preadv)(self.fd, [view], offset)
    if n != len(view):
      raise OSError(f"{self.path}: {n} of {len(view)} bytes at {offset}")

  def run(self, write: bool, threads: int, block: int) -> float:
    """One pass over the file (written: flushed); bytes per second."""
    ring, pool = self.methods[(threads, block)]
    jobs = [(ring[k % len(ring)][:min(block, self.size - off)], off)
            for k, off in enumerate(range(0, self.size, block))]
    start = time.perf_counter()
    if pool is None:
      for buf, off in jobs:
        self._request(write, buf, off)
    else:
      futures = [pool.submit(self._request, write, buf, off)
                 for buf, off in jobs]
      for f in futures:
        f.result()
    if write:
      os.fsync(self.fd)
    return self.size / (time.perf_counter() - start)

  def close(self) -> None:
    for _, pool in self.methods.values():
      if pool is not None:
        pool.shutdown()
    os.close(self.fd)


# ------------------------------------------------------------------ tier


def _leaf_sizes(params: int) -> list[int]:
  """``params`` parameters as a few leaves of a few sizes (none a multiple
  of the files' 4096-element alignment: each leaf's end is padded)."""
  small = [1000, 3 * 4096 + 7]
  big = [int(params * f) + 13 for f in (0.4, 0.25, 0.15, 0.1)]
  return big + small + [max(1, params - sum(big) - sum(small))]


class Tier:
  """An ``NvmeUpdate`` under ``root`` with ``options``, and one round's
  passes over it."""

  def __init__(self, root: str, options, sizes: list[int]):
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

    from zero_jax import offload  # pylint: disable=g-import-not-at-top

    self.options = options
    shapes = {f"w{i}": jax.ShapeDtypeStruct((n,), jnp.float32)
              for i, n in enumerate(sizes)}
    tx = offload.adamw(1e-3, weight_decay=0.1)
    self.host = offload.NvmeUpdate(tx, offload.rule_of(tx), shapes,
                                   jax.devices("cpu")[0], root, options)

  def _timed(self, name: str, fn) -> dict[str, float]:
    """Runs pass ``fn``: its bytes per second by the tier's count
    (``NvmeUpdate.io``), its seconds, its call's wall seconds, the
    process's CPU seconds per second of the call (every thread's), its
    waits."""
    cpu, start = os.times(), time.perf_counter()
    fn()
    call = time.perf_counter() - start
    cpu = sum(os.times()[:2]) - sum(cpu[:2])
    io = self.host.io
    moved = io["read"] + io["written"]
    return {f"{name} GB/s": moved / io["seconds"] / 1e9,
            f"{name} s": io["seconds"], f"{name} bytes": moved,
            f"{name} call s": call, f"{name} cores": cpu / call,
            f"{name} read wait s": io["waiting for reads"],
            f"{name} write wait s": io["waiting for writes"]}

  def write(self, master, opt_state) -> dict[str, float]:
    """The write pass: ``adopt`` (every slice filled from ``master`` and
    ``opt_state``, written, the files flushed). (Not ``init``, whose
    moments are zeros: a virtual disk may write and read zeros faster.)"""

    def run():
      self.state = self.host.adopt(master, opt_state)

    return self._timed("write", run)

  def read(self) -> dict[str, float]:
    """The read pass: ``verify`` (every slice of every file read, its
    checksums checked)."""
    return self._timed("read", self.host.verify)

  def update(self, grads, prepare) -> dict[str, float]:
    """An update: every slice read, updated (AdamW, the bf16 copy written
    in the same pass), written, the files flushed."""
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

    def run():
      m, o, _, _ = self.host.update(grads, *self.state, {}, prepare=prepare,
                                    compute_dtype=jnp.bfloat16)
      self.state = (m, o)

    return self._timed("update", run)

  def close(self) -> None:
    self.host.close()


def _prepare(sumsq, extra):
  """``FusedUpdate.update``'s ``prepare``: gradients as they are (divisor
  1, no clipping), always applied."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  del extra
  return (jnp.float32(1), False, jnp.sqrt(sumsq), jnp.float32(1)), None, None


# ---------------------------------------------------------------- report


def _load() -> str:
  """The host's 1-minute load average (other tenants' too)."""
  try:
    with open("/proc/loadavg", encoding="utf-8") as f:
      return f.read().split()[0]
  except OSError:
    return "?"


def _machine(path: str, direct: bool) -> str:
  """The host and the file system under ``path``."""
  path = os.path.realpath(path)
  best = ("?", "?", "")
  try:
    with open("/proc/mounts", encoding="utf-8") as f:
      for line in f:
        device, point, fstype = line.split()[:3]
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(best[2]):
          best = (device, fstype, point)
  except OSError:
    pass
  device, fstype, _ = best
  disk = os.path.basename(device)
  kind = ("virtual disk (virtio)" if disk.startswith("vd") else
          "NVMe drive" if disk.startswith("nvme") else "disk")
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
  return (f"{os.cpu_count()} cores, {ram:.0f} GiB RAM; `{path}` on {fstype}, "
          f"{device} ({kind}), "
          f"{'O_DIRECT' if direct else 'no O_DIRECT (page cache)'}")


def _in_turn(read: float, write: float) -> float:
  """GB/s of a pass that reads and writes as many bytes, one after the
  other, at the raw rates: the update's bar where the disk does not read
  and write at once."""
  return 2 / (1 / read + 1 / write)


def _fmt(x: float) -> str:
  return f"{x:.2f}"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--dir", required=True,
                  help="a directory on the disk to measure (the bench "
                  "works in a new directory under it, deleted at the end)")
  ap.add_argument("--gib", type=float, default=2.0,
                  help="GiB of the raw file and of one version of the "
                  "tier's files")
  ap.add_argument("--rounds", type=int, default=3,
                  help="rounds after the warm-up; medians are reported")
  ap.add_argument("--nvme", action="append", type=str, default=None,
                  metavar="NAME=VALUE,...",
                  help="a tier setting (NvmeOptions fields, e.g. "
                  "in_flight=16,block_bytes=4MiB); repeat to compare "
                  "several (default: NvmeOptions' defaults)")
  ap.add_argument("--note", default="",
                  help="a line added to the report (the disk, say)")
  ap.add_argument("--out", default=os.path.join(
      _ROOT, "experiments", "results", "nvme_bandwidth_cpu.md"))
  args = ap.parse_args(argv)
  if args.rounds < 1 or args.gib <= 0:
    ap.error("--rounds must be at least 1 and --gib positive")
  command = "PYTHONPATH=. python experiments/nvme_bench.py " + shlex.join(
      sys.argv[1:] if argv is None else argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  try:
    settings = [_options(s) for s in (args.nvme or [""])]
  except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
    ap.error(f"--nvme: {e}")
  defaults = _options("")
  size = max(4096, int(args.gib * 2**30) // 4096 * 4096)
  # (Twice the setting's requests too: the tier keeps in_flight reads and
  # in_flight writes in flight, on threads of their own.)
  methods = sorted({(k * o.in_flight, o.block_bytes) for o in settings
                    for k in (1, 2)} | {(1, _SINGLE_BLOCK)})
  sizes = _leaf_sizes(size // 12)  # (AdamW: 12 bytes a parameter)
  rng = np.random.default_rng(0)
  master = {f"w{i}": rng.standard_normal(n, np.float32)
            for i, n in enumerate(sizes)}
  grads = {k: (1e-3 * rng.standard_normal(x.size, np.float32)).astype(
      ml_dtypes.bfloat16) for k, x in master.items()}
  # AdamW's state with moments of random magnitudes (incompressible, as a
  # trained state's are), its scalars as init makes them.
  import jax  # pylint: disable=g-import-not-at-top

  from zero_jax import offload  # pylint: disable=g-import-not-at-top
  opt_state = jax.tree.map(
      lambda x: np.abs(1e-3 * rng.standard_normal(x.shape, np.float32))
      if x.ndim else np.asarray(x),
      offload.adamw(1e-3, weight_decay=0.1).init(master))
  os.makedirs(args.dir, exist_ok=True)
  load = [_load()]
  work = tempfile.mkdtemp(prefix="zero_jax_nvme_bench_", dir=args.dir)
  raw, tiers = None, []
  # Per round: raw[(write, method)] bytes/s; tier[setting][name] values.
  raw_got = {(w, m): [] for w in (False, True) for m in methods}
  tier_got = [[] for _ in settings]
  try:
    raw = Raw(os.path.join(work, "raw"), size, methods)
    tiers = [Tier(os.path.join(work, f"tier{i}"), o, sizes)
             for i, o in enumerate(settings)]
    for r in range(args.rounds + 1):  # (round 0: the warm-up)
      # Each direction's raw methods and tier passes side by side, every
      # other round in reverse order: a pass after a burst of writes may
      # meet the disk still flushing them (a virtual disk's host cache).
      got = [{} for _ in tiers]
      flip = (lambda xs: xs[::-1]) if r % 2 else (lambda xs: xs)
      for write in (True, False):
        for item in flip(list(methods) + list(range(len(tiers)))):
          if isinstance(item, tuple):
            rate = raw.run(write, *item)
            if r:
              raw_got[(write, item)].append(rate)
          else:
            tier = tiers[item]
            got[item].update(tier.write(master, opt_state) if write else
                             tier.read())
      for i in flip(list(range(len(tiers)))):
        got[i].update(tiers[i].update(grads, _prepare))
      if not r:
        continue
      for i, g in enumerate(got):
        tier_got[i].append(g)
      best_r = max(raw_got[(False, m)][-1] for m in methods)
      best_w = max(raw_got[(True, m)][-1] for m in methods)
      print(f"round {r}: raw read {best_r / 1e9:.2f} GB/s, write "
            f"{best_w / 1e9:.2f} GB/s; tier " + "; ".join(
                f"[{i}] read {g['read GB/s']:.2f}, write "
                f"{g['write GB/s']:.2f}, update {g['update GB/s']:.2f}"
                for i, g in enumerate(got)), flush=True)
    load.append(_load())
  finally:
    for tier in tiers:
      tier.close()
    if raw is not None:
      raw.close()
    shutil.rmtree(work, ignore_errors=True)

  med = statistics.median
  rounds = args.rounds
  best = {w: [max(raw_got[(w, m)][k] for m in methods) / 1e9
              for k in range(rounds)] for w in (False, True)}
  params = sum(sizes)
  lines = [
      "The NVMe tier's bandwidth beside the disk's: "
      f"{_machine(args.dir, raw.direct)}; load average {load[0]} at the "
      f"start, {load[-1]} at the end. Command: `{command}`", "",
      f"Raw: one file of {size / 2**30:.2f} GiB, written (then fsync) and "
      "read with O_DIRECT in aligned requests by each method below; the "
      "round's best method is the bar. Tier: `NvmeUpdate` with AdamW over "
      f"{params:,} parameters in {len(sizes)} leaves (12 bytes a "
      f"parameter: {tiers[0].host.disk_bytes() / 2**30:.2f} GiB a version); "
      "write = `adopt` of a state with random moments (fill, write, "
      "fsync), read = `verify` (read, "
      "checksums), update = `update` (read 12 B/param, AdamW with the "
      "bf16 copy, write 12 B/param, fsync): bytes and seconds of each "
      "pass by the tier's own count (`NvmeUpdate.io`); `update / raw in "
      "turn`: the update's GB/s over the rate of reading and writing its "
      "bytes one after the other at the round's raw rates, "
      "2 / (1/read + 1/write). GB/s = 1e9 bytes/s; "
      f"{rounds} round(s) after a warm-up, interleaved in one process; "
      "ratios within each round, medians below."]
  if args.note:
    lines += ["", args.note]
  for i, o in enumerate(settings):
    t = tier_got[i]
    lines += ["", f"Setting {i}: {_label(o)}"
              f"{' (the defaults)' if o == defaults else ''}", "",
              "| round | raw read GB/s | raw write GB/s | tier read GB/s | "
              "tier write GB/s | read tier/raw | write tier/raw | update "
              "GB/s | update / raw in turn | update s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    cols = {
        "raw read GB/s": best[False], "raw write GB/s": best[True],
        "tier read GB/s": [x["read GB/s"] for x in t],
        "tier write GB/s": [x["write GB/s"] for x in t],
        "update GB/s": [x["update GB/s"] for x in t],
        "update s": [x["update s"] for x in t]}
    cols["read tier/raw"] = [a / b for a, b in zip(cols["tier read GB/s"],
                                                   best[False])]
    cols["write tier/raw"] = [a / b for a, b in zip(cols["tier write GB/s"],
                                                    best[True])]
    cols["update / raw in turn"] = [u / _in_turn(r, w) for u, r, w in zip(
        cols["update GB/s"], best[False], best[True])]
    order = ["raw read GB/s", "raw write GB/s", "tier read GB/s",
             "tier write GB/s", "read tier/raw", "write tier/raw",
             "update GB/s", "update / raw in turn", "update s"]
    for k in range(rounds):
      lines.append(f"| {k + 1} | " + " | ".join(_fmt(cols[c][k])
                                               for c in order) + " |")
    lines.append("| median | " + " | ".join(_fmt(med(cols[c]))
                                            for c in order) + " |")
    lines += ["", (
        f"Update pass: {med([x['update bytes'] for x in t]) / 1e9:.2f} GB "
        f"moved (read and written) in {med([x['update s'] for x in t]):.3f}"
        f" s, of which waiting for reads "
        f"{med([x['update read wait s'] for x in t]):.3f} s and for "
        f"writes {med([x['update write wait s'] for x in t]):.3f} s; "
        "whole calls (medians): init "
        f"{med([x['write call s'] for x in t]):.3f} s, verify "
        f"{med([x['read call s'] for x in t]):.3f} s, update "
        f"{med([x['update call s'] for x in t]):.3f} s, using "
        f"{med([x['write cores'] for x in t]):.2f}, "
        f"{med([x['read cores'] for x in t]):.2f} and "
        f"{med([x['update cores'] for x in t]):.2f} cores (the process's "
        "CPU seconds per second).")]
  if len(settings) > 1:
    lines += ["", "Every setting's medians:", "",
              "| setting | tier read GB/s | tier write GB/s | read tier/raw"
              " | write tier/raw | update GB/s | update / raw in turn |",
              "|---|---|---|---|---|---|---|"]
    for i, o in enumerate(settings):
      t = tier_got[i]
      rr = [x["read GB/s"] / b for x, b in zip(t, best[False])]
      wr = [x["write GB/s"] / b for x, b in zip(t, best[True])]
      ur = [x["update GB/s"] / _in_turn(r, w)
            for x, r, w in zip(t, best[False], best[True])]
      lines.append(
          f"| {i}: {_label(o)} | {_fmt(med([x['read GB/s'] for x in t]))} | "
          f"{_fmt(med([x['write GB/s'] for x in t]))} | {_fmt(med(rr))} | "
          f"{_fmt(med(wr))} | {_fmt(med([x['update GB/s'] for x in t]))} | "
          f"{_fmt(med(ur))} |")
  lines += ["", "Raw methods (medians; the bar is each round's best):", "",
            "| raw method | read GB/s | write GB/s |", "|---|---|---|"]
  for m in methods:
    lines.append(f"| {Raw.name(*m)} | "
                 f"{_fmt(med(raw_got[(False, m)]) / 1e9)} | "
                 f"{_fmt(med(raw_got[(True, m)]) / 1e9)} |")
  text = "\n".join(lines) + "\n"
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  emit(text, args.out)


if __name__ == "__main__":
  main()
