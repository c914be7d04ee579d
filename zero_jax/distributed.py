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

Failures. In a multi-process run a process that dies must not leave the
others hanging in a collective. JAX's coordination service covers part of
it: a process whose coordinator (process 0) dies aborts at once, and the
coordinator aborts everyone ``heartbeat_timeout_seconds`` after any other
process stops sending heartbeats. ``initialize`` adds what it misses (with
``fail_fast=True``): a process that ends with an uncaught exception exits at
once (JAX would first wait in its shutdown barrier for the others, until
their heartbeats time out or, if they are alive but stuck in a collective,
for the 300 s shutdown timeout) and tells the others, which exit within a
second with the same exit code and a message naming the failed process and
its error. A ``SystemExit`` with a non-zero code in the main thread counts
as a failure with that exit code (code 0 does not: that process waits in
JAX's shutdown barrier for the others, as without ``fail_fast``). Calls of
``sys.exit(n)``, ``exit(n)`` and ``quit(n)`` are seen everywhere; a bare
``raise SystemExit(n)`` only under ``python -m zero_jax.launch``, which runs
the script through a wrapper that catches it (elsewhere it exits through
JAX's barrier). A ``SystemExit`` that the script catches and swallows still
counts, unless ``step_done()`` is called after it (training went on). A
process killed by a signal is for the launcher (or JAX's heartbeats) to
notice.

Hangs. Under ``python -m zero_jax.launch --watchdog SECONDS`` every process
reports its training steps through ``step_done()`` (``Engine.step`` calls
it), which touches a per-process file the launcher watches (at most once a
second; without the launcher's variable it does nothing). Importing this
module there also registers ``faulthandler`` on SIGUSR1, so that the
launcher can print a stuck process's Python stack.
"""

from __future__ import annotations

import atexit
import builtins
import dataclasses
import faulthandler
import math
import os
import signal
import sys
import threading
import time
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zero_jax.mesh import batch_axes

# Set by ``python -m zero_jax.launch`` for each process it starts.
ENV_COORDINATOR = "ZERO_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "ZERO_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "ZERO_JAX_PROCESS_ID"
ENV_CPU_DEVICES = "ZERO_JAX_CPU_DEVICES"
# Set by ``python -m zero_jax.launch --watchdog``: the file this process
# touches when it finishes a training step (``step_done``).
ENV_HEARTBEAT_FILE = "ZERO_JAX_HEARTBEAT_FILE"
# The signal on which a process started with ENV_HEARTBEAT_FILE prints every
# thread's Python stack to its stderr.
STACK_DUMP_SIGNAL = signal.SIGUSR1

# Seconds without heartbeats after which the coordination service declares a
# process dead and terminates all of them. JAX's default (100 s) lets a job
# whose collectives hang on a dead peer (NCCL) sit idle for almost two
# minutes; heartbeats come from a C++ thread, independent of the GIL and of
# long compilations, so 30 s is still far from false alarms.
DEFAULT_HEARTBEAT_TIMEOUT_SECONDS = 30

# The coordination-service key a failing process writes its error to.
_ABORT_KEY = "zero_jax/abort"
_POLL_SECONDS = 1.0
# Separates the error from the exit code in the abort value (a character no
# error message holds).
_CODE_MARK = "\x1f"
# step_done() touches the heartbeat file at most this often: a step costs at
# most one time.monotonic() call in between.
_HEARTBEAT_SECONDS = 1.0


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
  try:
    from jax._src import clusters  # pylint: disable=g-import-not-at-top
    # pylint: disable-next=protected-access
    kinds = list(clusters.ClusterEnv._cluster_types)
  except (ImportError, AttributeError):
    kinds = None
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


def _backend_initialized() -> bool:
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):
    return False  # (jax.distributed.initialize checks it too)


def _require_fresh_backend(what: str) -> None:
  if _backend_initialized():
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


def _global_state() -> Any:
  """JAX's distributed-runtime state (its client, process id and count), or
  None where a JAX version has moved it."""
  try:
    from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
    return jax_distributed.global_state
  except (ImportError, AttributeError):
    return None


def _client() -> Any:
  """JAX's coordination-service client, or None."""
  return getattr(_global_state(), "client", None)


class _FailFast:
  """Ends every process of a run promptly when one of them fails.

  A process whose main thread raises, or calls ``sys.exit`` with a non-zero
  code, writes its exit code and error to the coordination service and exits
  at once; a watchdog thread in every process polls for that error and exits
  too, with the same code.
  """

  def __init__(self, client: Any, process_id: int):
    self._client = client
    self._pid = process_id
    self._stop = threading.Event()
    self._exit_code = 0  # non-zero: this process failed, exit with it
    # The code of the main thread's last sys.exit() (None: not called, or
    # training went on after it).
    self.exit_requested: int | None = None
    self._previous_hook = sys.excepthook
    # (owner, name) -> (original, replacement) of each exit function wrapped.
    self._exits: dict[tuple[Any, str], tuple[Any, Any]] = {}
    self._thread = threading.Thread(target=self._watch, daemon=True,
                                    name="zero_jax-fail-fast")

  def start(self) -> None:
    sys.excepthook = self._excepthook
    # SystemExit never reaches sys.excepthook, and atexit handlers cannot see
    # the exit code: only an exit function that records it can tell a
    # failing sys.exit(3) from a normal end. (A bare ``raise SystemExit(3)``
    # is seen only where the launcher runs the script: _RUNNER there.)
    for owner, name in ((sys, "exit"), (builtins, "exit"), (builtins, "quit")):
      original = getattr(owner, name, None)
      if original is not None:  # (python -S has no exit() or quit())
        self._exits[owner, name] = (original, self._recording(original))
        setattr(owner, name, self._exits[owner, name][1])
    # Registered after JAX's own exit handler, so it runs first: it must
    # stop the watchdog before JAX shuts the client down.
    atexit.register(self._at_exit)
    self._thread.start()

  def stop(self) -> None:
    self._halt()
    atexit.unregister(self._at_exit)

  def _halt(self) -> None:
    self._stop.set()
    if self._thread.is_alive() and threading.current_thread() is not \
        self._thread:
      self._thread.join(timeout=5)
    # (==, not is: every self._excepthook is a new bound-method object.)
    if sys.excepthook == self._excepthook:
      sys.excepthook = self._previous_hook
    for (owner, name), (original, wrapped) in self._exits.items():
      if getattr(owner, name, None) is wrapped:
        setattr(owner, name, original)
    self._exits.clear()

  def _watch(self) -> None:
    while not self._stop.wait(_POLL_SECONDS):
      if _client() is not self._client:
        return  # jax.distributed.shutdown() was called
      try:
        message = self._client.key_value_try_get(_ABORT_KEY)
      except Exception:  # pylint: disable=broad-except
        # NOT_FOUND: nobody failed. Anything else: the coordinator is gone,
        # and JAX's own error polling terminates this process.
        continue
      if self._stop.is_set():
        return
      code, text = _parse_abort(str(message))
      _stderr(f"zero_jax.distributed: {text}; stopping process "
              f"{self._pid} too.")
      self._linger()
      # The failed process's code: whichever process the launcher sees end
      # first, the job's status is the failure's.
      os._exit(code)  # pylint: disable=protected-access

  def _recording(self, exit_function: Any) -> Any:
    """``exit_function`` (``sys.exit``, ``exit``, ``quit``), remembering the
    main thread's exit code."""
    def recording_exit(*args: Any) -> None:
      try:
        exit_function(*args)
      except SystemExit as e:
        self.note_exit(e.code)
        raise
    return recording_exit

  def note_exit(self, code: Any) -> None:
    """Records ``SystemExit(code)`` raised in the main thread. (In another
    thread, SystemExit ends only that thread.)"""
    if threading.current_thread() is threading.main_thread():
      self.exit_requested = _system_exit_code(code)

  def _excepthook(self, exc_type, exc, tb) -> None:
    self._previous_hook(exc_type, exc, tb)
    self._fail(1, f"process {self._pid} failed with {exc_type.__name__}: "
               f"{exc}")

  def _fail(self, code: int, text: str) -> None:
    """Marks this process failed with ``code`` and tells the others; if
    another process failed first, takes that one's code instead."""
    self._exit_code = code
    self._stop.set()
    if len(text) > 1000:
      text = text[:1000] + "..."

    def publish():
      try:
        self._client.key_value_set(_ABORT_KEY, _abort_value(code, text))
        return
      except Exception:  # pylint: disable=broad-except
        pass  # another process failed first, or the coordinator is gone
      try:
        first = self._client.key_value_try_get(_ABORT_KEY)
      except Exception:  # pylint: disable=broad-except
        return
      # This failure is most likely the other's consequence (a collective
      # with a process that has gone): the job's status is the first one's,
      # whichever process the launcher sees end first.
      self._exit_code, first_text = _parse_abort(str(first))
      _stderr(f"zero_jax.distributed: {first_text} before process "
              f"{self._pid} failed.")

    # In a thread, so that an unreachable coordinator cannot hold us here.
    sender = threading.Thread(target=publish, daemon=True)
    sender.start()
    sender.join(timeout=5)

  def _at_exit(self) -> None:
    if not self._exit_code and self.exit_requested:
      self._fail(self.exit_requested, f"process {self._pid} exited with "
                 f"code {self.exit_requested} (SystemExit)")
    self._halt()
    if self._exit_code:
      # Skip JAX's shutdown barrier: it would wait for processes that are
      # stuck in a collective with this one, until a timeout.
      _stderr(f"zero_jax.distributed: process {self._pid} exits with code "
              f"{self._exit_code} without waiting for the others "
              "(fail_fast).")
      self._linger()
      os._exit(self._exit_code)  # pylint: disable=protected-access

  def _linger(self) -> None:
    # Process 0 hosts the coordination service: give the others one more
    # poll to read the error before it disappears with this process.
    if self._pid == 0:
      time.sleep(2 * _POLL_SECONDS)


def _system_exit_code(code: Any) -> int:
  """The exit status ``SystemExit(code)`` gives, as the OS reports it."""
  if code is None:
    return 0
  if isinstance(code, int):
    return code & 0xFF  # (sys.exit(256) exits 0, sys.exit(-1) 255)
  return 1  # (Python prints a message to stderr and exits 1)


def _abort_value(code: int, text: str) -> str:
  """What a failing process publishes: its error, and its exit code unless
  that is 1 (an uncaught exception's)."""
  return text if code == 1 else f"{text}{_CODE_MARK}{code}"


def _parse_abort(value: str) -> tuple[int, str]:
  """``(exit code, text)`` of an ``_abort_value``."""
  text, mark, code = value.rpartition(_CODE_MARK)
  if mark:
    try:
      return int(code), text
    except ValueError:
      pass
  return 1, value


def _stderr(message: str) -> None:
  try:
    sys.stdout.flush()
    print(message, file=sys.stderr, flush=True)
  except Exception:  # pylint: disable=broad-except
    pass


_fail_fast: _FailFast | None = None


class _Heartbeat:
  """This process's heartbeat file, touched by ``step_done()``.

  Created when this module is imported under ``zero_jax.launch --watchdog``
  with mtime 0, which tells the launcher "running, no step yet"; every
  later mtime means a step.
  """

  def __init__(self, path: str):
    self.path = path
    self.due = 0.0  # time.monotonic() of the next touch

  def create(self) -> None:
    try:
      # O_EXCL: a subprocess of this one (a data loader) inherits the
      # variable and imports this module too; it must not reset the file.
      os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
      os.utime(self.path, ns=(0, 0))
    except OSError:
      pass

  def beat(self) -> None:
    now = time.monotonic()
    if now < self.due:
      return
    self.due = now + _HEARTBEAT_SECONDS
    try:
      os.utime(self.path)
    except OSError:
      pass  # (the launcher removed it: it is ending the job)


def _start_heartbeat(env: Mapping[str, str]) -> _Heartbeat | None:
  """The heartbeat the launcher asked for, if it did; registers the stack
  dump on ``STACK_DUMP_SIGNAL`` with it."""
  path = env.get(ENV_HEARTBEAT_FILE, "").strip()
  if not path:
    return None
  heartbeat = _Heartbeat(path)
  if sys.stderr is not None:
    try:
      # The launcher sends the signal when the watchdog fires: the stacks
      # say where the process hangs (in C code too, where Python's own
      # signal handlers would never run).
      faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr,
                            all_threads=True, chain=False)
    except (AttributeError, ValueError, OSError, RuntimeError):
      pass  # (no usable stderr file descriptor: no stacks)
  heartbeat.create()  # after the handler: the file says it is there
  return heartbeat


_heartbeat: _Heartbeat | None = _start_heartbeat(os.environ)


def _main_exited(code: Any) -> None:
  """The launcher's runner saw the script end with ``SystemExit(code)``."""
  guard = _fail_fast
  if guard is not None:
    guard.note_exit(code)


def step_done() -> None:
  """Reports that this process finished a training step.

  ``Engine.step`` calls it once per step; a training loop that does not use
  the engine calls it itself. It feeds the watchdog of ``python -m
  zero_jax.launch --watchdog SECONDS``, which ends a job whose processes go
  that long without a step. Costs one ``time.monotonic()`` call per step, a
  file touch at most once a second, and nothing at all when the launcher's
  watchdog is off.

  It also tells ``fail_fast`` that training went on after a ``sys.exit``
  the script caught: that call no longer decides the exit code.
  """
  heartbeat = _heartbeat
  if heartbeat is not None:
    heartbeat.beat()
  guard = _fail_fast
  if guard is not None and guard.exit_requested is not None:
    guard.exit_requested = None


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
      waiting for timeouts (see the module docstring).
    **kwargs: passed to ``jax.distributed.initialize`` (e.g.
      ``initialization_timeout``, ``shutdown_timeout_seconds``,
      ``cluster_detection_method``).

  Raises:
    ValueError: only some of the three settings are given, or the launcher's
      environment variables are malformed.
    RuntimeError: JAX's backend has started already (call ``initialize``
      earlier).
  """
  global _fail_fast
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
  state = _global_state()
  client = getattr(state, "client", None)
  if fail_fast and client is not None and state.num_processes > 1:
    _fail_fast = _FailFast(client, int(state.process_id))
    _fail_fast.start()


def shutdown() -> None:
  """Shuts the distributed runtime down (no-op if it is not running).

  Optional: it happens at exit anyway. Every process must call it (it waits
  for all of them).
  """
  global _fail_fast
  if _fail_fast is not None:
    _fail_fast.stop()
    _fail_fast = None
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
