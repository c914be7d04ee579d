"""Multi-process runs: start JAX's distributed runtime; feed each process.

Every process of a multi-process run calls ``initialize()`` first, before
anything else touches JAX devices, then builds the same mesh and engine. Each
process computes the same global batch and passes only its own rows to
``engine.step`` (``local_batch``)::

  from zero_jax import distributed
  distributed.initialize()          # before any other JAX call
  ...
  mesh = zj.make_mesh()             # all devices of all processes
  engine = zj.Engine(loss_fn, tx, config, mesh)
  for batch in batches:             # the global batch, on every process
    state, metrics = engine.step(state, distributed.local_batch(batch, mesh))

``initialize`` takes its settings from, in order: its arguments; the
environment set by ``python -m zero_jax.launch``; a cluster JAX detects
(SLURM ``srun``, Open MPI ``mpirun``, Cloud TPU, Kubernetes indexed jobs).
With none of these it does nothing, so the same script runs as a plain
single process.

Failures and hangs (a process that fails or stops making steps must not
leave the others waiting in a collective): ``initialize`` arms fail-fast
(``_failfast.py``); ``python -m zero_jax.launch --watchdog`` ends a hung job,
fed by ``zero_jax.distributed.step_done`` (``zero_jax.train.step_done``,
which ``Engine.step`` calls).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zero_jax._compat import backends_started, cluster_kinds, distributed_state
from zero_jax.distributed import _failfast
from zero_jax.layout._mesh import batch_axes
from zero_jax.train._agreement import ENV_NUM_PROCESSES, ENV_PROCESS_ID

# Set by ``python -m zero_jax.launch`` for each process it starts (with
# ENV_NUM_PROCESSES and ENV_PROCESS_ID, which the step's batch check in
# zero_jax.train reads too).
ENV_COORDINATOR = "ZERO_JAX_COORDINATOR"
ENV_CPU_DEVICES = "ZERO_JAX_CPU_DEVICES"
# Seconds without heartbeats after which the coordination service declares a
# process dead and terminates all of them. JAX's default (100 s) lets a job
# whose collectives hang on a dead peer (NCCL) sit idle for almost two
# minutes; heartbeats come from a C++ thread, independent of the GIL and of
# long compilations, so 30 s is still far from false alarms.
DEFAULT_HEARTBEAT_TIMEOUT_SECONDS = 30


@dataclasses.dataclass(frozen=True)
class _Settings:
  """What the launcher's environment variables ask for (None: not set)."""

  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  cpu_devices: int | None = None


def _int_var(env: Mapping[str, str], name: str, minimum: int) -> int | None:
  value = env.get(name, "").strip()
  if not value:
    return None
  try:
    n = int(value)
  except ValueError:
    n = None
  if n is None or n < minimum:
    raise ValueError(f"environment variable {name}={value!r} must be an "
                     f"integer >= {minimum}")
  return n


def _settings_from_env(env: Mapping[str, str]) -> _Settings:
  """Parses the variables ``zero_jax.launch`` sets.

  Raises:
    ValueError: a variable is malformed.
  """
  settings = _Settings(
      coordinator_address=env.get(ENV_COORDINATOR, "").strip() or None,
      num_processes=_int_var(env, ENV_NUM_PROCESSES, 1),
      process_id=_int_var(env, ENV_PROCESS_ID, 0),
      cpu_devices=_int_var(env, ENV_CPU_DEVICES, 1))
  if (settings.num_processes is not None and settings.process_id is not None
      and settings.process_id >= settings.num_processes):
    raise ValueError(
        f"{ENV_PROCESS_ID}={settings.process_id} is not below "
        f"{ENV_NUM_PROCESSES}={settings.num_processes}")
  return settings


def _detected_cluster() -> str | None:
  """The cluster environment ``jax.distributed.initialize()`` would
  bootstrap from, or None.

  Asks JAX's own detectors, so that whatever a JAX version supports is
  found, except Kubernetes outside an indexed job: JAX would claim every
  pod is a cluster and then fail to bootstrap a plain single-process one.
  """
  kinds = cluster_kinds()
  if kinds is None:
    # (JAX's internals moved: recognise the two common launchers by hand.)
    if all(v in os.environ for v in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST",
                                      "SLURM_NTASKS", "SLURM_PROCID",
                                      "SLURM_LOCALID")):
      return "slurm"
    return "ompi" if "OMPI_MCA_orte_hnp_uri" in os.environ else None
  for kind in kinds:
    if getattr(kind, "opt_in_only_method", False):
      continue
    if (kind.__name__ == "K8sCluster" and
        "JOB_COMPLETION_INDEX" not in os.environ):
      continue
    try:
      present = kind.is_env_present()
    except Exception:  # pylint: disable=broad-except
      present = False  # a broken detector must not break single-process runs
    if present:
      return getattr(kind, "name", "") or kind.__name__
  return None


def _one_process_per_node(env: Mapping[str, str]) -> bool:
  """Whether a SLURM or Open MPI job runs one process on this node."""
  if "SLURM_NTASKS" in env:
    nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES")
    return nodes is not None and env["SLURM_NTASKS"] == nodes
  return env.get("OMPI_COMM_WORLD_LOCAL_SIZE") == "1"


def _require_fresh_backend(what: str) -> None:
  # (Unknown: jax.distributed.initialize checks it too.)
  if backends_started():
    raise RuntimeError(
        f"zero_jax.distributed.initialize() must {what} before JAX's backend "
        "starts, but it has started already. Call initialize() at the top "
        "of the script, before anything that touches devices: jax.devices(), "
        "creating arrays, jax.random.PRNGKey(...), or importing a module "
        "that does one of these at import time.")


def _use_cpu_devices(n: int) -> None:
  """``n`` CPU devices in this process, collectives over gloo."""
  if (getattr(jax.config, "jax_num_cpu_devices", None) == n and
      getattr(jax.config, "jax_platforms", None) == "cpu"):
    return  # set by an earlier call
  _require_fresh_backend(f"set up {n} CPU devices ({ENV_CPU_DEVICES})")
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", n)
  try:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except AttributeError:
    pass  # (an option JAX dropped: gloo is its default for CPU)


def initialize(coordinator_address: str | None = None,
               num_processes: int | None = None,
               process_id: int | None = None, *,
               local_device_ids: int | Sequence[int] | None = None,
               heartbeat_timeout_seconds: int =
               DEFAULT_HEARTBEAT_TIMEOUT_SECONDS,
               fail_fast: bool = True,
               **kwargs: Any) -> None:
  """Starts JAX's distributed runtime if this is a multi-process run.

  Call it first in every process, before anything touches JAX devices. The
  settings come from, in order:

  1. the arguments (all three of ``coordinator_address``,
     ``num_processes`` and ``process_id``);
  2. the environment set by ``python -m zero_jax.launch``
     (``ZERO_JAX_COORDINATOR``, ``ZERO_JAX_NUM_PROCESSES``,
     ``ZERO_JAX_PROCESS_ID``; with ``--devices-per-proc``,
     ``ZERO_JAX_CPU_DEVICES`` gives each process that many CPU devices with
     collectives over gloo);
  3. a cluster JAX detects: SLURM (inside ``srun``), Open MPI
     (``mpirun``), Cloud TPU, Kubernetes indexed jobs. JAX gives each
     process one GPU there (process ``i`` on a node drives GPU ``i``),
     except that a job with one process per node gets all of the node's
     GPUs;
  4. none of these: a single-process run; nothing to do.

  Calling it again once the runtime is up does nothing.

  Args:
    coordinator_address: ``host:port`` of process 0, where it serves the
      coordination service; every process passes the same address.
    num_processes: the number of processes.
    process_id: this process's index, ``0 <= process_id < num_processes``.
    local_device_ids: the local devices (GPU ordinals) this process uses;
      default: see above (``JAX_LOCAL_DEVICE_IDS`` is honoured too).
    heartbeat_timeout_seconds: a process that sends no heartbeat for this
      long counts as dead, and the coordination service then terminates all
      processes. This bounds how long the others can hang after a process
      is killed (JAX's own default is 100 s).
    fail_fast: if a process ends with an uncaught exception or
      ``sys.exit(n)``, ``n`` non-zero, it exits at once and the others
      (polling once a second) exit too, with the same exit code, instead of
      waiting for timeouts (``zero_jax.distributed``'s fail-fast).
    **kwargs: passed to ``jax.distributed.initialize`` (e.g.
      ``initialization_timeout``, ``shutdown_timeout_seconds``,
      ``cluster_detection_method``).

  Raises:
    ValueError: only some of the three settings are given, or the launcher's
      environment variables are malformed.
    RuntimeError: JAX's backend has started already (call ``initialize``
      earlier).
  """
  if jax.distributed.is_initialized():
    return
  env = _settings_from_env(os.environ)
  coordinator_address = coordinator_address or env.coordinator_address
  if num_processes is None:
    num_processes = env.num_processes
  if process_id is None:
    process_id = env.process_id
  given = {"coordinator_address": coordinator_address,
           "num_processes": num_processes, "process_id": process_id}
  explicit = any(v is not None for v in given.values())
  if explicit and None in given.values():
    missing = ", ".join(k for k, v in given.items() if v is None)
    raise ValueError(
        f"initialize() got only some of coordinator_address, num_processes "
        f"and process_id (missing: {missing}); pass all three, or set "
        f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} (as "
        "python -m zero_jax.launch does), or pass none inside a cluster job "
        "(SLURM, Open MPI) to detect them.")
  if env.cpu_devices is not None:
    _use_cpu_devices(env.cpu_devices)
  if not explicit:
    if ("cluster_detection_method" not in kwargs and
        _detected_cluster() is None):
      return  # a plain single-process run
    if (local_device_ids is None and not os.environ.get("JAX_LOCAL_DEVICE_IDS")
        and _one_process_per_node(os.environ)):
      # JAX would give this process one GPU, as if there were one process
      # per GPU; with one process per node it should drive all of them. An
      # empty list restricts nothing.
      local_device_ids = []
  else:
    # Explicit settings: SLURM or MPI variables the launcher inherited must
    # not change which devices this process sees.
    kwargs.setdefault("cluster_detection_method", "deactivate")
  _require_fresh_backend("start the distributed runtime")
  jax.distributed.initialize(
      coordinator_address, num_processes, process_id,
      local_device_ids=local_device_ids,
      heartbeat_timeout_seconds=heartbeat_timeout_seconds, **kwargs)
  state = distributed_state()
  client = getattr(state, "client", None)
  if fail_fast and client is not None and state.num_processes > 1:
    _failfast.start_fail_fast(client, int(state.process_id))


def shutdown() -> None:
  """Shuts the distributed runtime down (no-op if it is not running).

  Optional: it happens at exit anyway. Every process must call it (it waits
  for all of them).
  """
  _failfast.stop_fail_fast()
  jax.distributed.shutdown()


def is_main_process() -> bool:
  """Whether this is process 0 (the one that should log and write files)."""
  return jax.process_index() == 0


def _row_ranges(index_slices: Sequence[slice],
                global_batch_size: int) -> list[tuple[int, int]]:
  """The disjoint, sorted ``[start, stop)`` row ranges that ``index_slices``
  (one per local device) cover, adjacent ranges merged."""
  rows = sorted({(s.start or 0,
                  global_batch_size if s.stop is None else s.stop)
                 for s in index_slices})
  merged: list[tuple[int, int]] = []
  for start, stop in rows:
    if merged and start < merged[-1][1]:
      raise ValueError(
          f"this process's devices hold overlapping batch rows {merged[-1]} "
          f"and {(start, stop)}; the batch must be split over the mesh, "
          "not replicated inside a process")
    if merged and start == merged[-1][1]:
      merged[-1] = (merged[-1][0], stop)
    else:
      merged.append((start, stop))
  return merged


def _process_row_ranges(mesh: Mesh,
                        global_batch_size: int) -> list[tuple[int, int]]:
  axes = batch_axes(mesh)
  shards = math.prod(mesh.shape[a] for a in axes)
  if global_batch_size % shards:
    raise ValueError(
        f"global batch size {global_batch_size} is not divisible by the "
        f"{shards} devices the batch is split over (mesh axes {axes}); use a "
        f"multiple of {shards}")
  sharding = NamedSharding(mesh, P(axes))
  index_map = sharding.addressable_devices_indices_map((global_batch_size,))
  return _row_ranges([idx[0] for idx in index_map.values()],
                     global_batch_size)


def process_batch_slice(mesh: Mesh, global_batch_size: int) -> slice:
  """The rows of the global batch that this process feeds to the engine.

  The batch is split over the mesh's batch axes (``data``, with
  ``replica`` outside it) in the engine's layout; this process feeds the
  rows its devices hold. Single process: all rows.

  Args:
    mesh: the engine's mesh.
    global_batch_size: the number of examples in the global batch.

  Returns:
    ``slice(start, stop)``.

  Raises:
    ValueError: the batch size does not divide over the mesh, or this
      process's rows are not one contiguous range (a mesh whose devices are
      not grouped by process; ``local_batch`` handles that case).
  """
  ranges = _process_row_ranges(mesh, global_batch_size)
  if len(ranges) != 1:
    raise ValueError(
        f"process {jax.process_index()} holds batch rows {ranges}, not one "
        "contiguous range: the mesh does not list each process's devices "
        "together (zero_jax.make_mesh() over jax.devices() does). Use "
        "local_batch(), which gathers those ranges, or reorder the mesh.")
  return slice(*ranges[0])


def local_batch(batch: Any, mesh: Mesh) -> Any:
  """This process's part of a global host batch.

  Every process computes the same global batch and passes
  ``local_batch(batch, mesh)`` to ``engine.step``: the rows its own devices
  hold (``process_batch_slice``), in order. Single process: the whole batch.

  Args:
    batch: a pytree of arrays (numpy or anything ``np.asarray`` accepts)
      whose leading dimension is the global batch.
    mesh: the engine's mesh.

  Returns:
    The same pytree of numpy arrays, each cut to this process's rows.

  Raises:
    ValueError: the leaves disagree on the batch size, a leaf is a scalar,
      or the batch size does not divide over the mesh.
  """
  leaves, treedef = jax.tree.flatten(batch)
  arrays = [np.asarray(x) for x in leaves]
  if not arrays:
    return batch
  for x in arrays:
    if x.ndim == 0:
      raise ValueError("batch leaves need a leading batch dimension; got a "
                       "scalar")
  sizes = {x.shape[0] for x in arrays}
  if len(sizes) > 1:
    raise ValueError(f"batch leaves disagree on the batch size: "
                     f"{sorted(sizes)}")
  ranges = _process_row_ranges(mesh, sizes.pop())
  if len(ranges) == 1:
    cut = [x[ranges[0][0]:ranges[0][1]] for x in arrays]
  else:
    # make_array_from_process_local_data reads the ranges back in order.
    cut = [np.concatenate([x[a:b] for a, b in ranges]) for x in arrays]
  return jax.tree.unflatten(treedef, cut)

