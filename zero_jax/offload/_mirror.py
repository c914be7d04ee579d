"""The host's CPU devices as a mirror of the mesh, for multi-process runs.

In a multi-process run the host update cannot split each leaf over the CPU
devices the way one process does (``_host.host_devices``): the gradients
and the compute copy would then cross between processes on their way to
and from the host. Instead each device of the mesh gets partners, CPU
devices of its own process (``partners``), and the host's state is laid
out on them as the device's ZeRO shards are on the mesh, each device's
block split among its partners (``host_spec``): every process updates the
shards its own devices hold, and every transfer between a device and the
host is a copy inside one process (``local_put``, ``local_gather``).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.sharding import SingleDeviceSharding


def partners(mesh: Mesh) -> dict:
  """Each device of ``mesh`` mapped to the CPU devices of its own process
  that update its shards: ``c`` each, the same ``c`` for every device.

  A process's partners are its CPU devices that the mesh does not use, in
  order, shared out among its devices: ``c`` is the largest power of two
  (so that most leaves' blocks divide by it) that every process can give
  each of its devices; where the mesh uses them all (a mesh of CPU
  devices), each device is its own one partner.

  Raises:
    ValueError: a process has fewer free CPU devices than devices in the
      mesh (the message names ``jax_num_cpu_devices``, the fix).
  """
  used = set(mesh.devices.flat)
  procs = sorted({d.process_index for d in used})
  mine = {p: [d for d in mesh.devices.flat if d.process_index == p]
          for p in procs}
  cpus = {p: [d for d in jax.devices("cpu") if d.process_index == p]
          for p in procs}
  free = {p: [d for d in cpus[p] if d not in used] for p in procs}
  if all(not free[p] and all(d in cpus[p] for d in mine[p]) for p in procs):
    return {d: (d,) for d in used}
  for p in procs:
    if len(free[p]) < len(mine[p]):
      raise ValueError(
          f"update_on='host' in a multi-process run updates each device's "
          f"shards on CPU devices of its process, but process {p} has "
          f"{len(mine[p])} devices in the mesh and {len(free[p])} free CPU "
          "device(s): call jax.config.update('jax_num_cpu_devices', "
          "os.cpu_count()) in every process before JAX starts (before "
          "anything creates an array or lists devices).")
  most = min(len(free[p]) // len(mine[p]) for p in procs)
  # A power of two: the blocks of most leaves divide by it.
  c = 1 << (most.bit_length() - 1)
  return {d: tuple(free[p][i * c:(i + 1) * c])
          for p in procs for i, d in enumerate(mine[p])}


def spec_axes(entry) -> tuple:
  """The mesh axes of one entry of a ``PartitionSpec``."""
  return () if entry is None else (entry,) if isinstance(entry, str) else (
      tuple(entry))


def without(spec: P, axis: str) -> P:
  """``spec`` with ``axis`` taken out of every entry."""
  return P(*[tuple(a for a in spec_axes(e) if a != axis) or None
             for e in spec])


def mirror_mesh(mesh: Mesh, partner: dict, axis: str) -> Mesh:
  """``mesh`` with each device replaced by its partners, along a new
  innermost ``axis``."""
  c = len(next(iter(partner.values())))
  devices = np.empty((*mesh.devices.shape, c), dtype=object)
  for index, d in np.ndenumerate(mesh.devices):
    devices[index] = partner[d]
  return Mesh(devices, (*mesh.axis_names, axis))


def host_spec(spec: P, shape: tuple, mesh: Mesh, axis: str) -> P:
  """``spec`` (a leaf's layout on the mesh of ``mirror_mesh``, without
  ``axis``) with each device's block split further over ``axis``: on the
  dimension already split over the mesh where the block divides (its
  partners then take contiguous sub-blocks), else on the first that
  divides; where none does, every partner holds the device's whole block.
  """
  c = mesh.shape[axis]
  entries = list(spec) + [None] * (len(shape) - len(spec))
  if c == 1:
    return P(*entries)
  blocks = [n // math.prod(mesh.shape[a] for a in spec_axes(e))
            for n, e in zip(shape, entries)]
  fits = [d for d, b in enumerate(blocks) if b % c == 0 and b >= c]
  if not fits:
    return P(*entries)
  split = [d for d in fits if entries[d] is not None]
  d = (split or fits)[0]
  entries[d] = (*spec_axes(entries[d]), axis)
  return P(*entries)


def within(outer: tuple, inner: tuple, shape: tuple) -> tuple | None:
  """``inner``'s index relative to ``outer``'s block (None: the same
  block), or raises if ``outer`` does not contain it."""
  rel, same = [], True
  for o, i, n in zip(outer, inner, shape):
    o0, o1, _ = o.indices(n)
    i0, i1, _ = i.indices(n)
    if not o0 <= i0 <= i1 <= o1:
      raise ValueError(
          f"a shard {inner} is not inside the source's shard {outer} on the "
          "partner device: the layouts do not nest (this is a bug)")
    same = same and (o0, o1) == (i0, i1)
    rel.append(slice(i0 - o0, i1 - o0))
  return None if same else tuple(rel)


def local_put(x: jax.Array, target: NamedSharding,
              source: Callable[[jax.Device], jax.Device]) -> jax.Array:
  """``x`` laid out as ``target``, each of this process's shards copied
  from ``x``'s shard on ``source(device)`` (a device of this process):
  nothing crosses between processes.

  ``x``'s shard on the source device must contain the target shard (the
  same block, or a whole replicated leaf sliced to it). The copy never
  shares a buffer with ``x``.
  """
  shards = {s.device: s for s in x.addressable_shards}
  out = []
  for d, index in target.addressable_devices_indices_map(x.shape).items():
    src = shards.get(source(d))
    if src is None:
      raise ValueError(
          f"no shard of the array on {source(d)}, the partner of {d}: it is "
          "not laid out on the mesh the host update mirrors")
    rel = within(src.index, index, x.shape)
    data = src.data if rel is None else src.data[rel]
    out.append(jax.device_put(
        data, SingleDeviceSharding(d, memory_kind=target.memory_kind),
        may_alias=False))
  return jax.make_array_from_single_device_arrays(x.shape, target, out)


def local_gather(x: jax.Array, target: NamedSharding,
                 sources: Callable[[jax.Device], tuple]) -> jax.Array:
  """``x`` laid out as ``target``, each of this process's shards assembled
  from ``x``'s shards on ``sources(device)`` (devices of this process,
  together holding the target shard): ``local_put``'s way back."""
  out = []
  for d, index in target.addressable_devices_indices_map(x.shape).items():
    mine = [s for s in x.addressable_shards if s.device in sources(d)]
    box = tuple(i.indices(n)[:2] for i, n in zip(index, x.shape))
    parts = []
    for s in mine:
      rel = within(index, s.index, x.shape)
      if rel is None:
        parts = [(None, s)]  # one partner holds the whole shard
        break
      parts.append((rel, s))
    covered = sum(math.prod(r.stop - r.start for r in rel)
                  for rel, _ in parts if rel is not None)
    if parts and parts[0][0] is None:
      block = parts[0][1].data
    elif covered == math.prod(hi - lo for lo, hi in box):
      block = np.empty([hi - lo for lo, hi in box], x.dtype)
      for rel, s in parts:
        block[rel] = np.asarray(s.data)
    else:
      raise ValueError(
          f"the shards of {sources(d)} do not make up the shard {index} of "
          f"{d} (this is a bug)")
    out.append(jax.device_put(
        block, SingleDeviceSharding(d, memory_kind=target.memory_kind),
        may_alias=False))
  return jax.make_array_from_single_device_arrays(x.shape, target, out)
