"""The device mesh: a ``data`` axis, optionally inside a ``replica`` axis and
around a ``model`` axis.

ZeRO shards state over ``data``. With ``replica=R`` the devices form R groups
(e.g. one per node) and state is sharded inside each group and replicated
across groups, like PyTorch FSDP's hybrid sharding or DeepSpeed's MiCS:
parameter gathers stay on fast intra-group links, and only the (already
reduce-scattered) gradient shards are all-reduced across groups. With hpZ
(``ZeroConfig.hpz_partition_size``) state is sharded over both axes
instead, and only backward's gathers stay inside a group.

With ``model=M`` each data-parallel rank is a group of M devices that split
the model itself (tensor parallelism, the paper's MP): the user's model says
how its parameters split over ``model`` and the compiler inserts the
tensor-parallel collectives, while ZeRO shards what each model rank holds
over ``data``. ``model`` is the innermost axis, so a model group is M
consecutive devices (one node's fast links), as in the paper's ZeRO-100B
runs: model parallelism within a node, ZeRO across nodes.
"""

from __future__ import annotations

import os
import warnings
from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh

from zero_jax._devices import is_compile_only

DATA = "data"
REPLICA = "replica"
MODEL = "model"


def simulate_cpu_devices(n: int = 8) -> None:
  """Gives JAX's CPU backend ``n`` devices: a multi-device mesh on a machine
  without an accelerator (on a GPU machine only the CPU backend changes).

  Call it before anything lists devices or creates an array. It does
  nothing under ``python -m zero_jax.launch`` (which sets each process's
  count) or where ``XLA_FLAGS`` already asks for a count, nor where JAX
  already started with ``n`` CPU devices.

  Raises:
    RuntimeError: JAX already started its backends with another count (the
      count is fixed then); the message says to call it first.
  """
  if ("ZERO_JAX_CPU_DEVICES" in os.environ or
      "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS",
                                                               "")):
    return
  try:
    jax.config.update("jax_num_cpu_devices", n)
  except RuntimeError:  # (JAX's: its backends are initialized)
    have = len(jax.devices("cpu"))
    if have == n:
      return
    raise RuntimeError(
        f"zero_jax.simulate_cpu_devices({n}) came too late: JAX has started"
        f" already, with {have} CPU device(s), and its device count cannot "
        "change now. Call it first thing, right after `import zero_jax`, "
        "before anything creates an array or lists devices (jnp.zeros, "
        "jax.devices(), zero_jax.make_mesh(), a model's init).") from None


def make_mesh(num_devices: int | None = None,
              devices: Sequence[jax.Device] | None = None, *,
              replica: int = 1, model: int = 1) -> Mesh:
  """Makes the mesh ZeRO shards over.

  Args:
    num_devices: use only the first ``num_devices`` devices (handy to compare
      device counts in one process). Default: all of them; where that is
      one CPU device of a machine with more cores, a warning names
      ``simulate_cpu_devices``.
    devices: explicit devices; overrides ``num_devices``.
    replica: number of replica groups R. 1 (default) gives a 1-D ``data``
      mesh; R > 1 gives a 2-D ``(replica, data)`` mesh of shape
      ``(R, devices // R)``: state sharded over ``data`` inside each group,
      replicated across groups, the batch split over both axes.
    model: devices M per tensor-parallel group. M > 1 adds an innermost
      ``model`` axis: the mesh is ``(data, model)`` or ``(replica, data,
      model)`` with ``data = devices // (replica * M)``. The batch is split
      over ``replica`` and ``data`` only; the model's own specs split its
      parameters over ``model``.

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
            "visible; on CPU call zero_jax.simulate_cpu_devices(N) first "
            "thing (or set XLA_FLAGS=--xla_force_host_platform_device_count"
            "=N), before JAX is first used.")
      devices = devices[:num_devices]
    elif len(devices) == 1:
      _warn_if_one_cpu_device(devices[0])
  devices = list(devices)
  for name, value in (("replica", replica), ("model", model)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  if len(devices) % (replica * model):
    raise ValueError(
        f"replica={replica} x model={model} does not divide the "
        f"{len(devices)} devices; choose them so that replica * model "
        f"divides {len(devices)} (the 'data' axis gets the rest: devices "
        "// (replica * model)).")
  shape = {REPLICA: replica, DATA: len(devices) // (replica * model),
           MODEL: model}
  names = tuple(a for a in (REPLICA, DATA, MODEL)
                if a == DATA or shape[a] > 1)
  return jax.make_mesh(tuple(shape[a] for a in names), names,
                       axis_types=(AxisType.Auto,) * len(names),
                       devices=devices)


def _warn_if_one_cpu_device(device: jax.Device) -> None:
  """Warns when the process's only device is a CPU device of a machine with
  more cores: most likely ``simulate_cpu_devices`` was not called, and
  ZeRO would shard nothing."""
  cores = os.cpu_count() or 1
  if (device.platform != "cpu" or cores == 1 or jax.process_count() > 1 or
      "ZERO_JAX_CPU_DEVICES" in os.environ):
    return
  warnings.warn(
      "zero_jax.make_mesh: JAX has 1 CPU device, so ZeRO shards nothing "
      f"(this machine has {cores} cores). For a multi-device mesh on CPU, "
      "call zero_jax.simulate_cpu_devices(n) first thing, before JAX starts"
      " (before anything creates an array or lists devices); for one device"
      " on purpose, zero_jax.make_mesh(num_devices=1).", stacklevel=3)


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


def auto_model_size() -> int:
  """Devices on an automatic ``model`` axis of the mesh being traced under
  (1 without one): inside the engine's step, the tensor-parallel degree the
  compiler partitions the model by."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or MODEL not in mesh.axis_names:
    return 1
  if dict(zip(mesh.axis_names, mesh.axis_types))[MODEL] != AxisType.Auto:
    return 1
  return mesh.shape[MODEL]


def replica_axes() -> tuple[str, ...]:
  """``("replica",)`` when tracing under a mesh that has it, else ``()``.

  Collectives call this inside ``shard_map`` to add the cross-group step.
  """
  return (REPLICA,) if REPLICA in jax.sharding.get_abstract_mesh().axis_names \
      else ()
