"""What the processes of a multi-process run must agree on, checked.

Two checks, each raising on every process rather than training on wrong
numbers:

* ``check_batch(batch, process_count)`` (``Engine.shard_batch``, so every
  step): all processes feed the same batch shapes. Each passes its own
  rows, and ``jax.make_array_from_process_local_data`` takes every process
  to have as many as this one: a process feeding 4 rows while another feeds
  8 would otherwise weight one process's rows double, without a word.
* ``check_initialized(process_count)`` (the same call, single process) and
  ``alone_at_exit()`` (the launcher's runner, when the script ends): a
  process that ``python -m zero_jax.launch`` started as one of several, but
  that JAX runs alone (the script never called
  ``zero_jax.distributed.initialize()``), would train by itself on its own
  devices and call itself process 0.

The exchange goes through JAX's coordination service (the key-value store
of the client that ``jax.distributed.initialize`` starts), not through a
device collective: the host would have to read a collective's result, and
that result is queued behind the step already dispatched, so every step
would wait for the previous one and JAX's asynchronous dispatch would be
lost. The key-value store never touches the device queue. It costs each
process three small requests to the coordinator per step: its own value
(``set``), everyone's so far (``dir_get``), then either the wait for the
others (a blocking ``get``) or, for the process that completes the round,
publishing the round (``set``); every ``_ROUNDS_PER_GROUP`` rounds one
process also deletes the group before (so the store does not grow).
Measured with 2 processes x 4 CPU devices on 2 cores: 1.4-2 ms a round;
behind a queued 0.5 s computation, 8-69 ms, where an all-gather of the row
counts waited the whole 456 ms.

Here, in ``train``, because the step checks its batch whether or not the
script ever imported ``zero_jax.distributed``: a runtime started by
``jax.distributed.initialize()`` alone, or a launched script that never
called ``zero_jax.distributed.initialize()``, must be refused all the same.
A process that failed is seen through ``_hooks``' abort probe, which
``zero_jax.distributed``'s fail-fast (the one that publishes failures)
sets.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import numpy as np

from zero_jax._compat import backends_started, distributed_state
from zero_jax.train import _hooks

# Set by ``python -m zero_jax.launch`` for each process it starts.
ENV_NUM_PROCESSES = "ZERO_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "ZERO_JAX_PROCESS_ID"
# How long a process waits for the others in one round before it gives up.
# Generous: processes legitimately drift apart between steps (one compiles
# longer, or writes a checkpoint's metadata), and the device collective the
# round stands before would wait as long. A process that fails ends the
# wait sooner (fail-fast, or JAX's heartbeats).
TIMEOUT_SECONDS = 600.0
# A waiting process looks for a failed one this often (blocking gets of at
# most this long; the coordinator answers as soon as the round completes).
_POLL_SECONDS = 1.0
_PREFIX = "zero_jax/agree"
# Rounds are grouped, so that one delete clears a finished group's keys.
_ROUNDS_PER_GROUP = 64

_rounds: dict[str, int] = {}  # tag -> rounds this process has taken part in


def _runtime() -> tuple[Any, int, int] | None:
  """(coordination client, process index, process count) of a running
  multi-process runtime, else None."""
  state = distributed_state()
  client = getattr(state, "client", None)
  if client is None or int(getattr(state, "num_processes", 1) or 1) < 2:
    return None
  return client, int(state.process_id), int(state.num_processes)


def exchange(tag: str, value: str,
             timeout: float = TIMEOUT_SECONDS) -> list[str]:
  """Every process's ``value`` for this round of ``tag``.

  A collective over the processes' hosts: every process calls it, the same
  number of times for each ``tag``. Nothing is queued on the devices.

  Args:
    tag: names the sequence of rounds (e.g. ``"batch"``); no ``/``.
    value: this process's value.
    timeout: seconds to wait for the others.

  Returns:
    The values by process index (``[value]`` without a multi-process
    runtime).

  Raises:
    RuntimeError: another process failed while this one waited (its error,
      as fail-fast published it), or the coordination service failed.
    TimeoutError: some process did not take part within ``timeout``
      seconds; the message names them.
  """
  runtime = _runtime()
  if runtime is None:
    return [value]
  client, pid, n = runtime
  count = _rounds[tag] = _rounds.get(tag, 0) + 1
  return exchange_round(client, pid, n, tag, count, value, timeout)


def exchange_round(client: Any, pid: int, n: int, tag: str, count: int,
                   value: str, timeout: float) -> list[str]:
  """Round ``count`` of ``exchange(tag, value)``: ``exchange`` with
  everything explicit.

  Args:
    client: JAX's coordination-service client (or one with its key-value
      methods).
    pid: this process's index.
    n: the number of processes.
    tag: as ``exchange``.
    count: the round, from 1; the same on every process.
    value: this process's value.
    timeout: seconds to wait for the others.

  Returns:
    The values by process index.

  Raises:
    RuntimeError, TimeoutError: as ``exchange``.
  """
  group, member = divmod(count, _ROUNDS_PER_GROUP)
  base = f"{_PREFIX}/{tag}/{group}/{member}"
  client.key_value_set(f"{base}/v/{pid}", value)
  values = _values(client.key_value_dir_get(f"{base}/v/"), n)
  if len(values) == n:
    # This process completed the round (several may see it complete: they
    # publish the same). Every process has left the rounds before it, so
    # the group before this one is done with.
    client.key_value_set(f"{base}/done", json.dumps(values),
                         allow_overwrite=True)
    if member == 0 and group > 0:
      client.key_value_delete(f"{_PREFIX}/{tag}/{group - 1}")
    return values
  return json.loads(_wait(client, base, n, tag, count, timeout))


def _values(entries: list[tuple[str, str]], n: int) -> list[str]:
  """The values of a round's entries, by process index; [] until all
  ``n`` processes have set theirs."""
  got = {int(key.rpartition("/")[2]): v for key, v in entries}
  return [got[i] for i in range(n)] if len(got) == n else []


def _wait(client: Any, base: str, n: int, tag: str, count: int,
          timeout: float) -> str:
  """The round's published values, once the last process has set its own.

  Raises:
    RuntimeError: another process failed meanwhile.
    TimeoutError: not every process set its value within ``timeout``.
  """
  deadline = time.monotonic() + timeout
  while True:
    wait = min(_POLL_SECONDS, max(deadline - time.monotonic(), 0.001))
    try:
      return client.blocking_key_value_get(f"{base}/done", int(wait * 1000))
    except Exception as e:  # pylint: disable=broad-except
      if "DEADLINE_EXCEEDED" not in str(e):
        raise RuntimeError(
            f"the processes' {tag} check (round {count}) failed in JAX's "
            f"coordination service: {e}") from e
    failed = _hooks.published_failure(client)
    if failed is not None:
      raise RuntimeError(
          f"another process failed while this one waited for the others' "
          f"{tag} (round {count}): {failed}")
    if time.monotonic() >= deadline:
      there = {int(k.rpartition("/")[2])
               for k, _ in client.key_value_dir_get(f"{base}/v/")}
      missing = [i for i in range(n) if i not in there]
      raise TimeoutError(
          f"process(es) {missing} did not reach round {count} of the "
          f"processes' {tag} check within {timeout:g} s of process(es) "
          f"{sorted(there)}: every process must call engine.step (and "
          "engine.shard_batch) the same number of times. A process that "
          "ran out of batches early, or is stuck, leaves the others "
          "waiting; give every process the same number of steps.")


# ------------------------------------------------------------ the batch


def _signature(batch: Any) -> tuple[list[int], list[list[Any]]]:
  """(the rows of each leading dimension, every leaf's [path, kind, shape,
  dtype]) of the leaves that hold data (``jax.ShapeDtypeStruct`` leaves,
  for lowering, are left out). ``host`` leaves are this process's rows,
  ``global`` ones (``jax.Array``) the whole batch."""
  leaves = []
  rows: list[int] = []
  for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
    if isinstance(x, jax.ShapeDtypeStruct):
      continue
    kind = "global" if isinstance(x, jax.Array) else "host"
    if not hasattr(x, "dtype"):
      x = np.asarray(x)  # (lists, Python numbers: as shard_batch takes them)
    shape = tuple(int(d) for d in np.shape(x))
    dtype = str(x.dtype)
    leaves.append([jax.tree_util.keystr(path) or "batch", kind, shape,
                   dtype])
    if kind == "host" and shape and shape[0] not in rows:
      rows.append(shape[0])
  return rows, leaves


def check_batch(batch: Any, process_count: int) -> None:
  """Raises, on every process, unless every process feeds the same batch
  shapes (a round of ``exchange``: call it once per batch, on every
  process). In a single-process run, only ``check_initialized``.

  Args:
    batch: what this process feeds (a pytree of host arrays, ``jax.Array``
      or ``jax.ShapeDtypeStruct`` leaves).
    process_count: ``jax.process_count()``.

  Raises:
    ValueError: the processes fed different shapes; the message names the
      rows (and shapes) each fed.
    RuntimeError: as ``check_initialized``, or ``exchange``.
    TimeoutError: as ``exchange``.
  """
  if process_count == 1:
    check_initialized(process_count)
    return
  if _runtime() is None:
    return  # (a runtime zero_jax cannot reach: nothing to exchange over)
  rows, leaves = _signature(batch)
  if not leaves:
    return  # (shapes only: nothing is fed)
  values = exchange("batch", json.dumps([rows, leaves]))
  if len(set(values)) == 1:
    return
  fed = [json.loads(v) for v in values]
  parts = []
  for i, (r, ls) in enumerate(fed):
    what = (f"{' or '.join(map(str, r))} rows" if r else
            "global arrays of " + ", ".join(f"{l[0]} {tuple(l[2])}"
                                            for l in ls[:4]))
    parts.append(f"process {i} fed {what}")
  detail = ""
  if len({json.dumps(r) for r, _ in fed}) == 1:
    # Same rows, other shapes or dtypes: name them.
    detail = "; leaves " + "; ".join(
        f"process {i}: " + ", ".join(f"{l[0]} {tuple(l[2])} {l[3]}"
                                     for l in ls[:6])
        for i, (_, ls) in enumerate(fed))
  raise ValueError(
      "the processes fed different batches to this step: "
      + ", ".join(parts) + detail + ". Every process must feed its slice "
      "of the same global batch, as many rows as every other process "
      "(zero_jax.distributed.local_batch(batch, mesh) cuts it); a last "
      "partial batch must be dropped, or padded to full size, on every "
      "process alike. (Else one process's rows would count more than "
      "another's.)")


# ---------------------------------------------- the launcher's processes


def launched_processes() -> int:
  """How many processes ``python -m zero_jax.launch`` started with this one
  (1 if it did not start this one, or the variable is malformed: then
  ``zero_jax.distributed.initialize`` reports it)."""
  try:
    return int(os.environ.get(ENV_NUM_PROCESSES, "1"))
  except ValueError:
    return 1


def uninitialized_error() -> str:
  """The error for a launched process that JAX runs alone."""
  n = launched_processes()
  pid = os.environ.get(ENV_PROCESS_ID, "?")
  return (f"{ENV_NUM_PROCESSES}={n} makes this process {pid} of {n} "
          "(python -m zero_jax.launch sets it), but JAX runs it alone "
          "(jax.process_count() == 1): the script never called "
          "zero_jax.distributed.initialize(), so each process would train "
          "by itself on its own devices. Call "
          "zero_jax.distributed.initialize() at the top of the script, "
          "before anything touches JAX devices. (A single-process run "
          f"started from a launched process: unset {ENV_NUM_PROCESSES} in "
          "its environment.)")


def check_initialized(process_count: int) -> None:
  """Raises if the launcher started this process as one of several but JAX
  runs it alone (``initialize()`` was never called). Cheap: one
  environment lookup.

  Args:
    process_count: ``jax.process_count()``.

  Raises:
    RuntimeError: that case; the message names
      ``zero_jax.distributed.initialize()``.
  """
  if process_count == 1 and launched_processes() > 1:
    raise RuntimeError(uninitialized_error())


def alone_at_exit() -> str | None:
  """``uninitialized_error()`` if the launcher started this process as one
  of several and it used JAX without the distributed runtime, else None
  (also when it never started JAX's backend: it used no device). The
  launcher's runner calls it when the script has ended; it starts no
  backend."""
  if launched_processes() < 2 or backends_started() is False:
    return None
  return uninitialized_error() if jax.process_count() == 1 else None
