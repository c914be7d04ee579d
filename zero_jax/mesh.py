"""The device mesh: one ``data`` axis over every device of every process."""

from __future__ import annotations

from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh

DATA = "data"


def make_mesh(num_devices: int | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Makes the 1-D ``data`` mesh ZeRO shards over.

  Args:
    num_devices: use only the first ``num_devices`` devices (handy to compare
      device counts in one process). Default: all of them.
    devices: explicit devices; overrides ``num_devices``.

  Returns:
    A mesh with one axis, ``"data"``. Its axis type is ``Auto`` so that
    ordinary jit code (the optax update) can run on the sharded arrays without
    ``jax.set_mesh``.
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
  return jax.make_mesh((len(devices),), (DATA,), axis_types=(AxisType.Auto,),
                       devices=devices)
