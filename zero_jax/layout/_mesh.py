"""The device mesh: a ``data`` axis, optionally inside a ``replica`` axis.

ZeRO shards state over ``data``. With ``replica=R`` the devices form R groups
(e.g. one per node) and state is sharded inside each group and replicated
across groups, like PyTorch FSDP's hybrid sharding or DeepSpeed's MiCS/hpZ:
parameter gathers stay on fast intra-group links, and only the (already
reduce-scattered) gradient shards are all-reduced across groups.
"""

from __future__ import annotations

import os
from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh

from zero_jax._devices import is_compile_only

DATA = "data"
REPLICA = "replica"


def simulate_cpu_devices(n: int = 8) -> None:
  """Gives JAX's CPU backend ``n`` devices: a multi-device mesh on a machine
  without an accelerator (on a GPU machine only the CPU backend changes).

  Call it before anything lists devices or creates an array. It does
  nothing under ``python -m zero_jax.launch`` (which sets each process's
  count) or where ``XLA_FLAGS`` already asks for a count.
  """
  if ("ZERO_JAX_CPU_DEVICES" in os.environ or
      "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS",
                                                               "")):
    return
  jax.config.update("jax_num_cpu_devices", n)


def make_mesh(num_devices: int | None = None,
              devices: Sequence[jax.Device] | None = None, *,
              replica: int = 1) -> Mesh:
  """Makes the mesh ZeRO shards over.

  Args:
    num_devices: use only the first ``num_devices`` devices (handy to compare
      device counts in one process). Default: all of them.
    devices: explicit devices; overrides ``num_devices``.
    replica: number of replica groups R. 1 (default) gives a 1-D ``data``
      mesh; R > 1 gives a 2-D ``(replica, data)`` mesh of shape
      ``(R, devices // R)``: state sharded over ``data`` inside each group,
      replicated across groups, the batch split over both axes.

  Returns:
    The mesh. Its axis types are ``Auto`` so that ordinary jit code (the
    optax update) can run on the sharded arrays without ``jax.set_mesh``.
  """
  if devices is None:
    devices = jax.devices()
    if num_devices is not None:
      if not 1 <= num_devices <= len(devices):
        raise ValueError(
            f"num_devices={num_devices} but {len(devices)} devices are "
            "visible; on CPU set XLA_FLAGS=--xla_force_host_platform_device_"
            "count=N (or jax.config.update('jax_num_cpu_devices', N)) before "
            "jax is first used.")
      devices = devices[:num_devices]
  devices = list(devices)
  if isinstance(replica, bool) or not isinstance(replica, int) or replica < 1:
    raise ValueError(f"replica must be a positive int, got {replica!r}")
  if len(devices) % replica:
    raise ValueError(
        f"replica={replica} does not divide the {len(devices)} devices; "
        f"choose a divisor of {len(devices)} (each replica group gets "
        "devices // replica devices on the 'data' axis).")
  if replica == 1:
    return jax.make_mesh((len(devices),), (DATA,),
                         axis_types=(AxisType.Auto,), devices=devices)
  return jax.make_mesh((replica, len(devices) // replica), (REPLICA, DATA),
                       axis_types=(AxisType.Auto,) * 2, devices=devices)


def layout_mesh(mesh: Mesh):
  """The mesh to build a ``NamedSharding`` on.

  ``mesh`` itself, except for compile-only devices (a GPU described by
  ``zero_jax.analysis.gpu_devices``, not present): they have no addressable memories, so a
  sharding on them silently drops ``memory_kind="pinned_host"``. Their
  shardings are built on ``mesh.abstract_mesh`` instead, and the step is
  compiled under ``jax.set_mesh(mesh)``.
  """
  if is_compile_only(mesh.devices.flat[0]):
    return mesh.abstract_mesh
  return mesh


def batch_axes(mesh) -> tuple[str, ...]:
  """The mesh axes the batch is split over: ``(replica, data)`` or
  ``(data,)``. Works on a ``Mesh`` and on the abstract mesh inside
  ``shard_map``."""
  return (REPLICA, DATA) if REPLICA in mesh.axis_names else (DATA,)


def replica_axes() -> tuple[str, ...]:
  """``("replica",)`` when tracing under a mesh that has it, else ``()``.

  Collectives call this inside ``shard_map`` to add the cross-group step.
  """
  return (REPLICA,) if REPLICA in jax.sharding.get_abstract_mesh().axis_names \
      else ()
