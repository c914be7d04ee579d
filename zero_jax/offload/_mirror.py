"""The host's CPU devices as a mirror of the mesh, for multi-process runs.

In a multi-process run the host update cannot split each leaf over the CPU
devices the way one process does (``_host.host_devices``): the gradients
and the compute copy would then cross between processes on their way to
and from the host. Instead each device of the mesh gets a partner, a CPU
device of its own process (``partners``), and the host's state is laid out
on the partners exactly as the device's ZeRO shards are on the mesh: every
process updates the shards its own devices hold, and every transfer
between a device and the host is a copy inside one process
(``local_put``).
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding


def partners(mesh: Mesh) -> dict:
  """Each device of ``mesh`` mapped to a CPU device of its own process.

  A process's partners are its CPU devices that the mesh does not use, in
  order; where the mesh uses them all (a mesh of CPU devices), each device
  is its own partner.

  Raises:
    ValueError: a process has fewer free CPU devices than devices in the
      mesh (the message names ``jax_num_cpu_devices``, the fix).
  """
  used = set(mesh.devices.flat)
  out = {}
  for proc in sorted({d.process_index for d in used}):
    mine = [d for d in mesh.devices.flat if d.process_index == proc]
    cpus = [d for d in jax.devices("cpu") if d.process_index == proc]
    free = [d for d in cpus if d not in used]
    if not free and all(d in cpus for d in mine):
      out.update((d, d) for d in mine)
      continue
    if len(free) < len(mine):
      raise ValueError(
          f"update_on='host' in a multi-process run updates each device's "
          f"shards on a CPU device of its process, but process {proc} has "
          f"{len(mine)} devices in the mesh and {len(free)} free CPU "
          "device(s): call jax.config.update('jax_num_cpu_devices', "
          "os.cpu_count()) in every process before JAX starts (before "
          "anything creates an array or lists devices).")
    out.update(zip(mine, free))
  return out


def mirror_mesh(mesh: Mesh, partner: dict) -> Mesh:
  """``mesh`` with each device replaced by its partner (same axes)."""
  devices = np.empty(mesh.devices.shape, dtype=object)
  for index, d in np.ndenumerate(mesh.devices):
    devices[index] = partner[d]
  return Mesh(devices, mesh.axis_names)


def _within(outer: tuple, inner: tuple, shape: tuple) -> tuple | None:
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
    rel = _within(src.index, index, x.shape)
    data = src.data if rel is None else src.data[rel]
    out.append(jax.device_put(
        data, SingleDeviceSharding(d, memory_kind=target.memory_kind),
        may_alias=False))
  return jax.make_array_from_single_device_arrays(x.shape, target, out)
