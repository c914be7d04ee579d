"""ZeRO-Infinity's NVMe tier (``offload_optimizer="nvme"``): the fp32 master
and the optimizer state in files, updated a slice at a time by the fused
host optimizer's kernels.

A step reads each slice of master and state, updates it with
``FusedUpdate``'s kernels (the compute copy written in the same pass) and
writes it back, while the I/O threads (``_disk``) read the next slices
and write the last: ``buffer_count`` slices in RAM at once. Gradients stay
in RAM: 12 bytes a parameter read and 12 written per step (AdamW), where
DeepSpeed also writes and reads the fp32 gradient (32).

Crash consistency: each tensor kind has two files, versions 0 and 1. A
step reads the committed version and writes the other; once every write
is flushed, ``manifest.json`` (``_manifest``) is replaced to name the new
version, the step, the loss scale, the optimizer's scalars and a checksum
per request. A process killed anywhere leaves the committed version
whole, for ``NvmeOptions(resume=True)``; every read checks its checksum.
The train state's master and moments are read-only ``np.memmap`` views
of the committed files; the optimizer's scalars live in RAM.
"""

from __future__ import annotations

import collections
import pathlib
import time
from typing import Any, Callable
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zero_jax.offload import _disk, _kernels
from zero_jax.offload._buffers import aligned
from zero_jax.offload._fused import FusedUpdate
from zero_jax.offload._manifest import (FORMAT, decode, encode,
                                       read_manifest, write_manifest)
from zero_jax.offload._optimizers import HostRule
from zero_jax.offload._slices import DiskPlan

class NvmeUpdate(FusedUpdate):
  """The fused host optimizer on state that lives in files.

  ``FusedUpdate``'s interface, which ``OnHost`` drives.

  Args:
    tx: an optimizer of ``zero_jax.offload``'s constructors.
    rule: its rule (``rule_of(tx)``).
    master: the fp32 master as ``jax.ShapeDtypeStruct`` leaves (a tree).
    cpu: the CPU device where the step's scalar programs run.
    path: ``nvme_path``; this process keeps its files in ``process-<i>``.
    options: ``NvmeOptions``.
    delayed: as ``FusedUpdate``'s.
  """

  in_ram = "the slices in flight"

  def __init__(self, tx: optax.GradientTransformation, rule: HostRule,
               master: Any, cpu: Any, path: str, options: Any,
               delayed: bool = False):
    super().__init__(tx, rule, master, cpu, delayed)
    self.options = options
    self.root = pathlib.Path(path) / f"process-{jax.process_index()}"
    leaves = jax.tree.leaves(master)
    n = len(leaves)
    big = [s for s, b in zip(jax.tree.leaves(self.opt_shapes), self._big)
           if b]
    per = len(big) // n
    dtypes = [np.dtype(np.float32)]
    for t in range(per):
      kind = {np.dtype(s.dtype) for s in big[t * n:(t + 1) * n]}
      if len(kind) != 1 or any(s.shape != x.shape for s, x in zip(
          big[t * n:(t + 1) * n], leaves)):
        raise ValueError(
            "offload_optimizer='nvme' keeps each part of the optimizer "
            "state in a file of one dtype, shaped like the parameters; "
            f"this optimizer's part {t} is not")
      dtypes.append(kind.pop())
    self.plan = DiskPlan.of([x.size for x in leaves], dtypes,
                            options.slice_bytes)
    self._shapes = [x.shape for x in leaves]
    self._ends: dict[int, list[int]] = collections.defaultdict(list)
    for j, i in enumerate(self.plan.last_slice()):
      self._ends[i].append(j)
    self._pool: _disk.Pool | None = None
    self._files: dict[tuple[int, int], _disk.File] = {}
    self._maps: dict[tuple[int, int, int], np.ndarray] = {}
    self._slots: list[list[np.ndarray]] | None = None
    self._version: int | None = None  # (the committed one)
    self._next: int | None = None  # (the one the running update writes)
    self._sums: list | None = None  # (per kind, slice: request checksums)
    self._new_sums: list | None = None
    self._step: int | None = None
    self._small: list[np.ndarray] = []  # (the optimizer's scalars)
    self._shown: int | None = None  # (the version the live views show)
    # Per version, what readers of its views (a save) wait for first.
    self._holds: dict[int, list[Callable[[], None]]] = {}
    self.io: dict[str, float] = {}  # (the last pass: bytes and seconds)

  # ------------------------------------------------------------ files

  def _file(self, kind: int, version: int, resize: bool = False
            ) -> _disk.File:
    key = (kind, version)
    if key not in self._files:  # (once open, a file has the plan's size)
      self.root.mkdir(parents=True, exist_ok=True)
      f = self._files[key] = _disk.File(
          self.root / f"{'master' if kind == 0 else f'state{kind}'}."
          f"{version}", self.plan.file_bytes(kind), self.options.direct,
          resize)
      if self.options.direct and not f.direct:
        warnings.warn(
            f"the file system under {str(self.root)!r} refuses O_DIRECT: "
            "the NVMe tier's reads and writes go through the page cache "
            "(host RAM); use a local disk's file system (ext4, xfs) for "
            "nvme_path, or NvmeOptions(direct=False) to choose this",
            stacklevel=2)
    return self._files[key]

  def _io(self) -> _disk.Pool:
    if self._pool is None:
      self._pool = _disk.Pool(self.options.in_flight,
                              self.options.block_bytes)
      # (Its threads and the files go with this updater.)
      weakref.finalize(self, _disk.close_all, self._pool, self._files)
    return self._pool

  def _slot_buffers(self) -> list[list[np.ndarray]]:
    """``buffer_count`` slots, each a slice's buffer per kind."""
    if self._slots is None:
      s = self.plan.slice_elements
      self._slots = [[aligned((s,), d) for d in self.plan.dtypes]
                     for _ in range(self._buffers())]
    return self._slots

  def _buffers(self) -> int:
    """Slices in RAM at once: ``buffer_count``, or fewer if there are."""
    return min(self.options.buffer_count, len(self.plan.slices))

  def budget_bytes(self) -> int:
    """Host RAM the slices in flight take."""
    return self._buffers() * self.plan.slice_elements * sum(
        d.itemsize for d in self.plan.dtypes)

  def _pass(self, read_from: int | None,
            on_slice: Callable[[int, list[np.ndarray]], None],
            write_to: int | None, kinds: tuple[int, ...] | None = None
            ) -> list | None:
    """One pass over the slices: each read from version ``read_from``
    (None: not read; its buffers zeroed), ``on_slice(i, buffers)``, then
    written to version ``write_to`` (None: not written) and the files
    flushed; only the tensor ``kinds`` given are read (default: all).
    Slices are read ahead into every free buffer (the next one waiting
    for the oldest write if it must). Returns the written requests'
    checksums (per kind, per slice)."""
    plan, o, pool = self.plan, self.options, self._io()
    kinds = tuple(range(len(plan.dtypes))) if kinds is None else kinds
    slots = self._slot_buffers()
    free = list(range(len(slots)))
    reading: dict[int, tuple[int, list]] = {}
    writing: collections.deque = collections.deque()
    sums = (None if write_to is None else
            [[None] * len(plan.slices) for _ in plan.dtypes])
    waited = {"read": 0.0, "write": 0.0}
    begun, before = time.perf_counter(), (pool.bytes_read,
                                          pool.bytes_written)

    def views(slot: int, i: int) -> list[np.ndarray]:
      return [b[:plan.slices[i].size] for b in slots[slot]]

    def retire() -> None:
      i, slot, futures = writing.popleft()
      t0 = time.perf_counter()
      for t, fs in enumerate(futures):
        _disk.done(fs)
        sums[t][i] = [f.result() for f in fs]
      waited["write"] += time.perf_counter() - t0
      free.append(slot)

    def start(i: int, wait: bool) -> bool:
      while writing and all(f.done() for fs in writing[0][2] for f in fs):
        retire()  # (writes already done: their buffers are free)
      if not free:
        if not (wait and writing):
          return False
        retire()
      slot = free.pop()
      bufs = views(slot, i)
      if read_from is None:
        for b in bufs:
          b[...] = 0
        reading[i] = (slot, [])
        return True
      reading[i] = (slot, [pool.read(
          self._file(t, read_from), bufs[t],
          plan.slices[i].start * bufs[t].itemsize, self._sums[t][i],
          self._step) for t in kinds])
      return True

    ahead = -1
    try:
      for i in range(len(plan.slices)):
        if i not in reading:
          start(i, wait=True)
          ahead = max(ahead, i)
        while (o.read_ahead and read_from is not None and
               ahead + 1 < len(plan.slices) and
               start(ahead + 1, wait=ahead + 1 == i + 1)):
          ahead += 1
        slot, futures = reading.pop(i)
        t0 = time.perf_counter()
        for fs in futures:
          _disk.done(fs)
        waited["read"] += time.perf_counter() - t0
        bufs = views(slot, i)
        on_slice(i, bufs)
        if write_to is None:
          free.append(slot)
          continue
        writing.append((i, slot, [pool.write(
            self._file(t, write_to), b, plan.slices[i].start * b.itemsize)
                                  for t, b in enumerate(bufs)]))
        if not o.write_behind:
          retire()
      while writing:
        retire()
      if write_to is not None:
        _disk.done([pool.run(self._file(t, write_to).sync)
                    for t in range(len(plan.dtypes))])
    except BaseException:
      # (No request may still fill or drain a buffer once this returns.)
      for _, futures in reading.values():
        for fs in futures:
          _disk.done_quietly(fs)
      for _, _, futures in writing:
        for fs in futures:
          _disk.done_quietly(fs)
      raise
    seconds = time.perf_counter() - begun
    self.io = {"seconds": seconds,
               "read": pool.bytes_read - before[0],
               "written": pool.bytes_written - before[1],
               "waiting for reads": waited["read"],
               "waiting for writes": waited["write"]}
    return sums

  # ----------------------------------------------------------- commits

  def _commit_version(self, version: int, sums: list, kept: Any) -> None:
    """Names ``version`` committed, with the step's small state."""
    step = None
    if kept is not None:
      step = int(np.asarray(kept["step"]))
      kept = encode(jax.tree.leaves(kept))
    write_manifest(self.root, {
        "format": FORMAT, "version": version, "step": step,
        "optimizer": self.rule.kind.value, "plan": self.plan.signature(),
        "sums": sums, "small": encode(self._small), "kept": kept})
    self._version, self._sums, self._step = version, sums, step

  def _commit(self, kept: Any) -> None:
    self._commit_version(self._next, self._new_sums, kept)

  def _skipped(self, kept: Any) -> None:
    self._commit_version(self._version, self._sums, kept)

  # ------------------------------------------------------------- views

  def _publish(self, master: Any, opt_state: Any, updated: bool = False
               ) -> tuple[Any, Any]:
    """Read-only views of the version committed (``updated``: the one the
    running update writes), the optimizer's scalars in RAM."""
    del master, opt_state
    v = self._shown = self._next if updated else self._version
    maps = [[self._map(t, j, v) for j in range(len(self._shapes))]
            for t in range(len(self.plan.dtypes))]
    master = jax.tree.unflatten(jax.tree.structure(self.master_shapes),
                                maps[0])
    big = iter(x for kind in maps[1:] for x in kind)
    small = iter(self._small)
    opt = [next(big) if b else next(small) for b in self._big]
    opt_state = jax.tree.unflatten(jax.tree.structure(self.opt_shapes), opt)
    # (New views, the live ones from now on, as FusedUpdate's.)
    master, opt_state = jax.tree.map(lambda x: x.view(), (master, opt_state))
    self._live = {id(x): x for x in jax.tree.leaves((master, opt_state))}
    return master, opt_state

  def owns(self, x: Any) -> bool:
    """Never: the live views' files are written two updates later, and a
    save of them holds them until then (``hold``)."""
    del x
    return False

  def hold(self, tree: Any, wait: Callable[[], None]) -> None:
    """A reader of ``tree`` (a save in the background): the next write of
    the version its views show waits for ``wait()`` first."""
    if any(self.live(x) for x in jax.tree.leaves(tree)):
      self._holds.setdefault(self._shown, []).append(wait)

  def _release(self, version: int) -> None:
    """Waits for the readers of ``version`` before it is written."""
    for wait in self._holds.pop(version, []):
      wait()

  def _map(self, kind: int, leaf: int, version: int) -> np.ndarray:
    """Leaf ``leaf`` of kind ``kind``'s file of ``version``, mapped once
    (each step publishes new views of it)."""
    key = (kind, leaf, version)
    if key not in self._maps:
      dtype = self.plan.dtypes[kind]
      f = self._file(kind, version)
      self._maps[key] = np.memmap(
          f.path, dtype, "r", offset=self.plan.offsets[leaf] * dtype.itemsize,
          shape=(max(self.plan.sizes[leaf], 1),))[
              :self.plan.sizes[leaf]].reshape(self._shapes[leaf])
    return self._maps[key]

  # -------------------------------------------------------- init, resume

  def init(self, master: Any, commit: Any = None) -> tuple[Any, Any]:
    """The state from ``master`` (any arrays) and ``tx.init``, written a
    slice at a time; or, where ``nvme_path`` holds a committed state and
    ``resume`` is True, that state (``resumed`` then holds its step's
    small tree)."""
    self.wait()
    record = read_manifest(self.root)
    if record is not None:
      if self.options.resume is None:
        raise FileExistsError(
            f"{self.root} holds the NVMe tier's state of step "
            f"{record.get('step')}, committed by an earlier run: pass "
            "NvmeOptions(resume=True) to continue it, resume=False to start "
            "afresh over it, or another nvme_path")
      if self.options.resume:
        return self._resume(record)
    stub = jax.tree.map(lambda x: jnp.stack([x, -3 * x - 1]),
                        jax.tree.map(lambda _: jnp.float32(1),
                                     self.master_shapes))
    with jax.default_device(self.cpu):
      first = jax.tree.leaves(jax.jit(self.tx.init)(stub))
    fills = [np.asarray(x) for x, b in zip(first, self._big) if b]
    if any(f[0] != f[1] for f in fills):
      raise ValueError("offload_optimizer='nvme' writes the optimizer's "
                       "first state as constants; this optimizer's depends "
                       "on the parameters")
    self._small = [np.array(x) for x, b in zip(first, self._big) if not b]
    n = len(self._shapes)
    leaves = jax.tree.leaves(master)
    return self._write_all(
        lambda t, j: leaves[j] if t == 0 else fills[(t - 1) * n + j][0],
        commit)

  def adopt(self, master: Any, opt_state: Any, commit: Any = None
            ) -> tuple[Any, Any]:
    """Master and optimizer state (arrays anywhere: a restore's) written to
    the files as a new committed version."""
    self.wait()
    opt = jax.tree.leaves(opt_state)
    self._small = [np.array(x) for x, b in zip(opt, self._big) if not b]
    big = [x for x, b in zip(opt, self._big) if b]
    leaves = jax.tree.leaves(master)
    n = len(leaves)
    return self._write_all(
        lambda t, j: leaves[j] if t == 0 else big[(t - 1) * n + j], commit)

  def _write_all(self, source: Callable[[int, int], Any], kept: Any
                 ) -> tuple[Any, Any]:
    """Every kind's leaves from ``source(kind, leaf)`` (an array, or a
    scalar to fill with) written as a new version, then committed."""
    # (Beside the committed version, this run's or an earlier one's: until
    # the new manifest is in place, that one stays whole.)
    committed = self._version
    if committed is None:
      record = read_manifest(self.root)
      committed = None if record is None else record.get("version")
    version = 1 - committed if committed in (0, 1) else 0
    flat: dict[tuple[int, int], Any] = {}

    def on_slice(i: int, bufs: list[np.ndarray]) -> None:
      for seg in self.plan.slices[i].segments:
        for t, b in enumerate(bufs):
          key = (t, seg.leaf)
          if key not in flat:
            x = source(*key)
            flat[key] = (np.asarray(x).reshape(-1) if np.ndim(x) or
                         key[0] == 0 else np.asarray(x))
          x = flat[key]
          b[seg.at:seg.at + seg.hi - seg.lo] = (
              x[seg.lo:seg.hi] if x.ndim else x)

    self._release(version)
    for t in range(len(self.plan.dtypes)):
      for v in (0, 1):  # (files of another layout, about to be replaced)
        self._file(t, v, resize=True)
    sums = self._pass(None, on_slice, version)
    self._commit_version(version, sums, kept)
    self.resumed = None
    return self._publish(None, None)

  def _resume(self, record: dict) -> tuple[Any, Any]:
    if (record.get("plan") != self.plan.signature() or
        record.get("optimizer") != self.rule.kind.value or
        len(record.get("small", ())) != self._big.count(False)):
      raise ValueError(
          f"{self.root} holds the NVMe tier's state of another model, "
          "optimizer or NvmeOptions.slice_bytes: resume it with the run "
          "that wrote it, or pass resume=False or another nvme_path")
    self._small = decode(record["small"])
    self._version, self._sums = record["version"], record["sums"]
    self._step = record["step"]
    self.resumed = (None if record["kept"] is None else
                    decode(record["kept"]))
    return self._publish(None, None)

  # ------------------------------------------------------------ update

  def update(self, *args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
    self.wait()
    self._next = 1 - self._version
    self._release(self._next)
    return super().update(*args, **kwargs)

  def _update_leaves(self, k, g, master_blocks, per_leaf, bufs, step,
                     leaf_done) -> None:
    del master_blocks, per_leaf  # (the files hold them)

    def on_slice(i: int, b: list[np.ndarray]) -> None:
      for seg in self.plan.slices[i].segments:
        j, at, m = seg.leaf, seg.at, seg.hi - seg.lo
        out = (_kernels.NOTHING if bufs is None else
               _kernels.as_kernel_array(bufs[j][0])[seg.lo:seg.hi])
        self._run(k, b[0][at:at + m], g[j][0][seg.lo:seg.hi],
                  [x[at:at + m] for x in b[1:]], out, *step, self._decay[j])
      for j in self._ends.get(i, ()):
        leaf_done(j)

    self._new_sums = self._pass(self._version, on_slice, self._next)

  def _cast_into(self, k, master: Any, bufs: list) -> None:
    """The compute copy into ``bufs``, read from the files a slice at a
    time."""
    del master  # (views of the files)

    def on_slice(s: int, b: list[np.ndarray]) -> None:
      for seg in self.plan.slices[s].segments:
        k.cast(b[0][seg.at:seg.at + seg.hi - seg.lo],
               _kernels.as_kernel_array(bufs[seg.leaf][0])[seg.lo:seg.hi])

    self._pass(self._version, on_slice, None, kinds=(0,))

  def verify(self) -> None:
    """Reads every file of the committed state and checks each request
    against its checksum (``DiskError`` names the first that differs)."""
    self.wait()
    self._pass(self._version, lambda i, b: None, None)

  # ---------------------------------------------------------- reporting

  def host_bytes(self, copy_dtype: Any, grad_dtype: Any,
                 background: bool = False) -> int:
    """Host RAM: the compute copy and gradients as ``FusedUpdate``'s, and
    the slices' budget in place of the state."""
    return (super().host_bytes(copy_dtype, grad_dtype, background) -
            self.state_bytes() + self.budget_bytes())

  def disk_bytes(self) -> int:
    """Bytes of one version of the files (two are kept)."""
    return sum(self.plan.file_bytes(t) for t in range(len(self.plan.dtypes)))

  def describe(self) -> str:
    o, plan = self.options, self.plan
    per = sum(d.itemsize for d in plan.dtypes)
    direct = all(f.direct for f in self._files.values()) and o.direct
    line = (
        f"{super().describe()}; NVMe tier: master and state in files under "
        f"{str(self.root)!r}, two versions of {self.disk_bytes() / 2**30:,.2f}"
        f" GiB ({'O_DIRECT' if direct else 'through the page cache'}), "
        f"{len(plan.slices)} slice(s) of up to {plan.slice_elements:,} "
        f"parameters; {self.budget_bytes() / 2**20:,.1f} MiB of host RAM "
        f"for {self._buffers()} slices, {o.in_flight} requests in flight "
        "each way of up "
        f"to {o.block_bytes / 2**20:g} MiB; per step {per} bytes a "
        f"parameter read and {per} written, gradients kept in RAM")
    if self.io.get("seconds"):
      io = self.io
      line += (f"; the last pass read {io['read'] / 1e9:,.2f} GB and wrote "
               f"{io['written'] / 1e9:,.2f} GB in {io['seconds']:.2f} s "
               f"({(io['read'] + io['written']) / io['seconds'] / 1e9:.2f} "
               f"GB/s), {io['waiting for reads']:.2f} s of it waiting for "
               "reads")
    return line

  def close(self) -> None:
    """Waits for the update, closes the files and the I/O threads."""
    self.wait()
    _disk.close_all(self._pool, self._files)
    self._pool = None
