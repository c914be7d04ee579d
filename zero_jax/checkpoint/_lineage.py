"""Which run each checkpoint of a directory belongs to, and what a save may
replace.

Why. A step number alone does not say which history a checkpoint is of.
After ``restore(step=1)`` and training on with other settings, the run's
next save of step 2 meets the step 2 of the abandoned run; keeping the old
one would have a restart resume the abandoned history. A second writer in
the same directory (another job, or a copy of this one) is the same
situation seen from the other side.

How. Every checkpoint records the *run* that wrote it: an id, and the ids
of the runs it continues (its lineage). A run starts at a process's first
save into a directory (a fresh run: no parent) or at each ``restore`` (a
run whose parent is the restored checkpoint). Before a save, ``plan_save``
sorts the directory's checkpoints:

- the restored checkpoint and those before it, of its lineage: kept;
- this run's own: kept (one of the step being saved, of other values, is a
  second state for one step: a conflict);
- those after the restored step of the restored run's lineage: the
  abandoned branch, moved aside (under ``abandoned/``, where no restore
  looks) before the save;
- any other: another run's, in this directory now or before: a conflict,
  an error naming whose and what to do.

The same values as the checkpoint of that step (its checksums, from
``_integrity``) are not a new save at all.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import threading
from typing import Any, Callable
import uuid


@dataclasses.dataclass(frozen=True)
class Run:
  """A run of training as the checkpoints it writes record it.

  Attributes:
    id: unique per run.
    lineage: the ids of the runs it continues, oldest first, then its own.
    parent_step: the step it was restored from (None: a fresh run).
  """

  id: str
  lineage: tuple[str, ...]
  parent_step: int | None = None

  @classmethod
  def fresh(cls, run_id: str | None = None) -> "Run":
    run_id = run_id or uuid.uuid4().hex
    return cls(run_id, (run_id,))

  def continuing(self, step: int, run_id: str | None = None) -> "Run":
    """The run that starts by restoring ``step``, written by this one."""
    run_id = run_id or uuid.uuid4().hex
    return Run(run_id, (*self.lineage, run_id), step)

  def record(self) -> dict[str, Any]:
    """What a checkpoint's metadata stores of the run that wrote it."""
    return {"id": self.id, "lineage": list(self.lineage),
            "parent_step": self.parent_step, "host": socket.gethostname(),
            "pid": os.getpid(),
            "time": datetime.datetime.now(datetime.timezone.utc)
                    .isoformat(timespec="seconds")}


# The run each directory is written by in this process, with the run whose
# checkpoint it restored: shared by every Checkpointer of the directory (one
# closed and another opened go on with the same run).
_RUNS: dict[str, tuple[Run, Run | None]] = {}
_RUNS_LOCK = threading.Lock()


def writing(directory: str, new_id: Callable[[], str]
            ) -> tuple[Run, Run | None]:
  """The run this process writes ``directory`` with (a fresh one, of id
  ``new_id()``, at its first save), and the run it restored from."""
  with _RUNS_LOCK:
    known = _RUNS.get(directory)
  if known is None:
    fresh = (Run.fresh(new_id()), None)
    with _RUNS_LOCK:
      known = _RUNS.setdefault(directory, fresh)
  return known


def continue_from(directory: str, parent: Run, step: int,
                  run_id: str) -> None:
  """A restore of ``parent``'s checkpoint of ``step``: this process now
  writes ``directory`` with a new run that continues it."""
  with _RUNS_LOCK:
    _RUNS[directory] = (parent.continuing(step, run_id), parent)


# Checkpoints written before runs were recorded: one unnamed run.
UNRECORDED = "unrecorded"


def run_of(meta: dict[str, Any]) -> Run:
  """The run that wrote a checkpoint, from its metadata."""
  run = meta.get("run")
  if not isinstance(run, dict) or not run.get("id"):
    return Run(UNRECORDED, (UNRECORDED,))
  return Run(str(run["id"]), tuple(map(str, run.get("lineage") or
                                       [run["id"]])),
             run.get("parent_step"))


def writer_of(meta: dict[str, Any]) -> str:
  """Who wrote a checkpoint, for an error message."""
  run = meta.get("run")
  if not isinstance(run, dict):
    return "a run that recorded no writer (an older zero_jax)"
  return (f"run {str(run.get('id'))[:8]} (host {run.get('host')}, pid "
          f"{run.get('pid')}, {run.get('time')})")


@dataclasses.dataclass(frozen=True)
class SavePlan:
  """What a save of one step does to a directory.

  Attributes:
    identical: that step is saved already with these very values: nothing
      to write.
    set_aside: steps of the abandoned branch, to move aside first.
    conflicts: ``(step, why)`` of checkpoints this save must not pass;
      non-empty means the save is refused.
  """

  identical: bool
  set_aside: tuple[int, ...]
  conflicts: tuple[tuple[int, str], ...]


def plan_save(step: int, sums: dict[str, int], run: Run,
              parent: Run | None, stored: dict[int, dict[str, Any]]
              ) -> SavePlan:
  """Sorts a directory's checkpoints before ``run`` saves ``step``.

  Args:
    step: the step being saved.
    sums: its checksums (``_integrity.checksums``).
    run: the run saving.
    parent: the run that wrote the checkpoint ``run`` restored (None for a
      fresh run).
    stored: every committed checkpoint's metadata, by step.
  """
  identical = False
  set_aside, conflicts = [], []
  for t, meta in sorted(stored.items()):
    writer = run_of(meta)
    if t == step and sums and meta.get("checksums") == sums:
      identical = True
      continue
    restored = run.parent_step is not None and parent is not None
    mine = writer.id == run.id
    if (restored and not mine and t > run.parent_step and
        parent.id in writer.lineage):
      set_aside.append(t)  # (the branch restore(step=) abandoned)
    elif t == step:
      conflicts.append((t, f"saved by {writer_of(meta)} with other values"))
    elif mine:
      if t > step:
        conflicts.append((t, "saved by this run, so the state being saved "
                             "is older"))
    elif not (restored and t <= run.parent_step and
              writer.id in run.lineage):
      conflicts.append((t, f"written by {writer_of(meta)}, which this run "
                           "did not restore from"))
  return SavePlan(identical, tuple(set_aside), tuple(conflicts))


def conflict_message(directory: str, step: int, plan: SavePlan,
                     run: Run) -> str:
  """The error for a refused save: whose checkpoints, and the fixes."""
  lines = "; ".join(f"step {t}: {why}" for t, why in plan.conflicts)
  restored = (f"this run restored step {run.parent_step}" if
              run.parent_step is not None else
              "this run restored no checkpoint of it")
  return (
      f"refusing to save step {step} in {directory!r}: the directory holds "
      f"checkpoints of another history ({lines}; {restored}). Saving would "
      "mix two runs, and a restart would resume whichever step is newest. "
      "If another job writes there now, give each job its own directory. "
      "To continue the run stored there, restore it first "
      "(Checkpointer.restore(engine, params), or step=k to roll back: the "
      "steps after k are then moved aside). To start over, save to a new "
      "directory or move the old steps away.")


def aside_name(parent_step: int | None) -> str:
  """The folder under ``abandoned/`` for one branch's steps: when, and from
  which step the run that abandoned them went on."""
  when = datetime.datetime.now(datetime.timezone.utc).strftime(
      "%Y%m%dT%H%M%S")
  return f"after-step-{parent_step}-{when}-{uuid.uuid4().hex[:6]}"
