"""Checkpoints with orbax that restore into any stage, mesh and offload.

A checkpoint holds the *logical* train state: the fp32 master parameters
and the optimizer state as whole arrays (each written as its shards by the
process that owns them; nothing is gathered), the step, the rng key and the
float16 loss scale. Layout is not part of it: restoring builds the target
layout from the engine it is restored into (any stage, device count, mesh,
offload; no conversion step) and orbax reads each device's shard of it
straight from disk. The compute-dtype copy is not stored: redone on restore.

The loop that resumes, saves and stops on preemption is in
docs/checkpoints.md; ``_export`` writes and reads the parameters alone.

Nothing is lost and nothing restores silently wrong: every array carries a
checksum, verified at restore (``_integrity``); every checkpoint records
its run (``_lineage``): after ``restore(step=k)`` the first save moves the
abandoned steps after k to ``abandoned/``, and a save among another run's
checkpoints is refused. Around ``Checkpointer``: ``_stored`` (what a
checkpoint holds), ``_reader`` (reads one, explains a corrupt one),
``_matching`` (does it fit the model), ``_multihost`` (agreeing on a save),
``_errors``, ``_files`` (the file system), ``_last_checkpoint`` (the one a
failed step names) and ``_orbax`` (the one reader of orbax's internals).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from typing import Any, Callable
import weakref

from etils import epath
import jax
import orbax.checkpoint as ocp

from zero_jax import offload
from zero_jax.checkpoint import _integrity, _last_checkpoint, _lineage
from zero_jax.checkpoint._errors import (CheckpointConflictError,
                                         CheckpointWriteError)
from zero_jax.checkpoint._files import COMMIT_FILE, check_usable, commit_time
from zero_jax.checkpoint._matching import outline
from zero_jax.checkpoint._multihost import agreed, agreed_id, sync
from zero_jax.checkpoint._orbax import (before_threads_join,
                                        current_operation_id,
                                        release_waiting_threads)
from zero_jax.checkpoint._reader import Reader
from zero_jax.checkpoint._sigterm import Sigterm
from zero_jax.checkpoint._stored import ls_dict, stored_tree
from zero_jax.train import Engine, TrainState
# Where the steps a rollback abandoned go: a name no restore reads as a step.
ABANDONED = "abandoned"


class Checkpointer:
  """Saves and restores ``TrainState`` s under one directory, with orbax.

  Every process of a multi-process run must create it and call ``save``
  and ``restore`` together (each writes and reads only its own shards).

  Args:
    directory: where checkpoints go, one sub-directory per step (created).
      A local path or anything orbax accepts (e.g. ``gs://``).
    max_to_keep: keep only the last ``max_to_keep`` checkpoints (None: all).
    async_save: ``save`` returns once the state is copied off the devices
      and writes in a background thread; the next ``save``, ``wait`` or
      ``close`` waits for it. A save is committed by an atomic rename, so a
      process killed mid-save leaves the previous checkpoints intact and
      ``latest_step`` never returns a partial one.
    handle_sigterm: in a single-process run, catch SIGTERM so that
      ``reached_preemption`` turns true, once the training loop has called
      it (before that, and on a second SIGTERM, the process terminates as
      usual). Multi-process runs use JAX's preemption service instead,
      which agrees on one step for all processes.
    read_only: restore only: nothing is written, created or deleted, so a
      read-only mount works (``save`` raises). ``max_to_keep`` is ignored.

  Raises:
    OSError: a local ``directory`` is a file, or cannot be created or
      written (``NotADirectoryError``, ``PermissionError``, ...); with
      ``read_only``, is not a readable directory. The message names the
      path and the fix.
  """

  def __init__(self, directory: str | os.PathLike, *,
               max_to_keep: int | None = 3, async_save: bool = True,
               handle_sigterm: bool = True, read_only: bool = False):
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
    self.directory = os.fspath(directory)
    self.read_only = read_only
    self._local = "://" not in self.directory
    if self._local and read_only:
      if not os.path.isdir(self.directory):
        raise FileNotFoundError(
            f"no checkpoint directory {self.directory!r} to restore from "
            "(read_only=True creates nothing); pass the directory the "
            "checkpoints were saved to")
    elif self._local:
      # Orbax would accept a file or an unwritable path here and fail only
      # in its background threads, which then keep the process alive.
      check_usable(self.directory)
    if read_only:
      max_to_keep = None
    self._manager = ocp.CheckpointManager(
        os.path.abspath(self.directory) if self._local else self.directory,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "loss_scale": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
            create=not read_only, read_only=read_only))
    self._root = epath.Path(self._manager.directory)
    self._reader = Reader(self._manager, self.directory, self._root,
                          self.all_steps)
    self._key = str(self._root)  # (this directory's run, in _RUNS)
    # (step, orbax's operation id, checksums) of the save in flight.
    self._pending: tuple[int, str | None, dict] | None = None
    self._committed: set[int] = set()  # steps verified on disk
    self._max_to_keep = max_to_keep
    self._check_no_strays()
    before_threads_join(_weakly(self._finish_at_exit))
    self._closed = False
    self._sigterm = Sigterm(
        handle_sigterm and not read_only and jax.process_count() == 1 and
        threading.current_thread() is threading.main_thread())

  def _check_no_strays(self) -> None:
    """Raises if ``max_to_keep`` would count directories that are not
    committed zero_jax checkpoints: orbax keeps the highest step numbers,
    so a stray ``9`` would have it delete the real checkpoints instead."""
    if self._max_to_keep is None:
      return
    strays = sorted(set(self._manager.all_steps()) - set(self.all_steps()))
    if strays:
      raise FileExistsError(
          f"{self.directory!r} holds directories named like steps that are "
          f"not committed zero_jax checkpoints: {strays} (an interrupted save "
          "or foreign files). With max_to_keep, orbax would count them as "
          "checkpoints and delete real ones in their place. Move or delete "
          "them, or save to another directory (max_to_keep=None keeps "
          "everything and only reads past them).")

  # ---------------------------------------------------------------- save

  def save(self, state: TrainState, *,
           engine: Engine | None = None) -> bool:
    """Saves ``state`` as the checkpoint of step ``state.step``.

    Every array's checksum goes into the checkpoint, for ``restore`` to
    verify. After ``restore(step=k)``, the first save moves the steps after
    k, of the history that restore abandoned, into ``abandoned/`` (printed
    on stderr; a ``Checkpointer`` of that folder restores them).

    Args:
      state: the train state (not consumed: keep training with it).
      engine: the engine that made it; if given, its config is recorded in
        the checkpoint's metadata (shown when a restore fails).

    Returns:
      True if a checkpoint was started; False if this very state (the same
      step and values) is saved or being saved already, e.g. a periodic and
      a preemption save of one step.

    Raises:
      CheckpointWriteError: the previous asynchronous save failed (nothing
        of this step is started then), or the directory cannot take this
        one. The checkpoints committed before are intact.
      CheckpointConflictError: the directory holds checkpoints of another
        run, or another state of this step; nothing was written.
      FileExistsError: the directory of this step exists but is not a
        committed zero_jax checkpoint.
      PermissionError: the Checkpointer is ``read_only``.
    """
    self._check_open("save")
    if self.read_only:
      raise PermissionError(
          f"Checkpointer({self.directory!r}, read_only=True) cannot save; "
          "create a Checkpointer without read_only to save, into a "
          "writable directory")
    offload.settle()  # (host state a background update still writes)
    step = int(state.step)
    sums = _integrity.checksums(stored_tree(state))
    if self._pending is not None and self._pending[0] == step:
      if self._pending[2] == sums:
        return False  # (e.g. a periodic and a preemption save coincide)
      raise CheckpointConflictError(
          f"refusing to save step {step} in {self.directory!r}: a different "
          f"state of step {step} is being saved already. Each step has one "
          "state: restore(step=k) to start another history from step k.",
          step, self.directory)
    self._finish()  # (orbax would wait for the previous save here anyway)
    self._check_no_strays()
    if (step in self._manager.all_steps() and
        not self._is_committed(step)):
      raise FileExistsError(
          f"{str(self._step_path(step))!r} exists but is not a committed "
          "zero_jax checkpoint (an interrupted save or a foreign directory); "
          "move or delete it, then save again")
    run, parent = _lineage.writing(self._key, agreed_id)
    plan = _lineage.plan_save(step, sums, run, parent, {
        t: self._reader.meta(t) for t in self.all_steps()})
    plan = agreed(plan)
    if plan.conflicts:
      raise CheckpointConflictError(_lineage.conflict_message(
          self.directory, step, plan, run), step, self.directory)
    if plan.identical:
      return False
    if plan.set_aside:
      self._set_aside(plan.set_aside, run.parent_step)
    if self._local:
      try:
        check_usable(self.directory)
      except OSError as e:
        raise self._write_error(step, e, "could not start") from e
    items = {"state": ocp.args.StandardSave(stored_tree(state)["state"])}
    if state.loss_scale is not None:
      items["loss_scale"] = ocp.args.StandardSave(ls_dict(state.loss_scale))
    meta = {"format": 1, "step": step,
            "num_devices": jax.device_count(),
            "process_count": jax.process_count(),
            "opt_state": outline(state.opt_state),
            "run": run.record(),
            "checksum": _integrity.ALGORITHM, "checksums": sums}
    if engine is not None:  # (JSON: tuples become lists)
      meta["config"] = dataclasses.asdict(engine.config)
    try:
      started = self._manager.save(step, args=ocp.args.Composite(
          meta=ocp.args.JsonSave(meta), **items))
    except (OSError, ValueError) as e:  # (orbax's "could not create")
      release_waiting_threads(current_operation_id())
      raise self._write_error(step, e, "failed") from e
    if not started:
      # Orbax skips a step it holds already (checked above) or one its
      # policies decline: never silently.
      raise self._write_error(step, RuntimeError(
          "orbax's CheckpointManager declined to save this step"),
          "was not started")
    self._pending = (step, current_operation_id(), sums)
    if offload.in_place(state):
      self._finish()  # (host buffers the next update overwrites in place)
    else:  # (files the NVMe tier overwrites two updates later)
      offload.hold(state, self._settle)
    return True

  def _set_aside(self, steps: tuple[int, ...], parent_step: int | None
                 ) -> None:
    """Moves the abandoned branch's ``steps`` to ``abandoned/<name>/``,
    where restores never look (process 0 moves; all wait for it)."""
    folder = self._root / ABANDONED / _lineage.aside_name(parent_step)
    if jax.process_index() == 0:
      folder.mkdir(parents=True, exist_ok=True)
      for t in steps:
        self._step_path(t).rename(folder / str(t))
    sync(f"zero_jax_set_aside_{parent_step}_{steps[-1]}")
    self._committed.difference_update(steps)
    self._manager.reload()
    self._forget_if_gone()
    print(f"zero_jax.Checkpointer: steps {list(steps)} belong to the run "
          f"abandoned by restore(step={parent_step}); moved to "
          f"{str(folder)!r} (Checkpointer({str(folder)!r}, read_only=True) "
          "restores them)", file=sys.stderr, flush=True)

  def wait(self) -> None:
    """Blocks until the last asynchronous save is committed.

    Raises:
      CheckpointWriteError: it failed; the checkpoints committed before are
        intact.
    """
    self._finish()

  def close(self) -> None:
    """Waits for pending saves and releases the directory.

    Raises:
      CheckpointWriteError: the last save failed (the directory is released
        all the same).
    """
    try:
      self._finish()
    except BaseException:
      self._release(quiet=True)  # the first error is the one to report
      raise
    self._release(quiet=False)

  def _check_open(self, what: str) -> None:
    if self._closed:
      raise RuntimeError(
          f"this Checkpointer of {self.directory!r} is closed (close(), or "
          f"the end of its with block): it cannot {what}. Create a new "
          f"Checkpointer({self.directory!r}) to {what}.")

  def _release(self, quiet: bool) -> None:
    self._closed = True
    try:
      self._manager.close()
    except Exception:  # pylint: disable=broad-except
      if not quiet:
        raise
    finally:
      self._sigterm.uninstall()
      self._forget_if_gone()  # (e.g. its directory was removed)

  def _finish(self) -> None:
    """Waits for the pending save; a failure becomes a CheckpointWriteError
    naming its step (orbax raises it once, unnamed, or only logs it)."""
    pending, self._pending = self._pending, None
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      if pending is None:
        raise
      raise self._failed(pending, e) from e
    if pending is not None and not self._is_committed(pending[0]):
      # Orbax logs some failures (e.g. of its commit callback) and goes on.
      raise self._failed(pending, RuntimeError(
          "the checkpoint was not committed; see orbax's log above"))
    if pending is not None:
      _last_checkpoint.record(self.directory, pending[0])

  def _settle(self) -> None:
    """Waits for the pending save (a failure is the next wait's error)."""
    if not self._closed:
      try:
        self._manager.wait_until_finished()
      except Exception:  # pylint: disable=broad-except
        pass

  def _finish_at_exit(self) -> None:
    """At exit, waits for the pending save and reports a failure on stderr:
    a program that never calls ``wait`` or ``close`` would otherwise lose
    the error, and hang if the failure left orbax's threads waiting."""
    if self._pending is None:
      return
    try:
      self._finish()
    except Exception as e:  # pylint: disable=broad-except
      print(f"zero_jax.Checkpointer at exit: {e}", file=sys.stderr,
            flush=True)

  def _failed(self, pending: tuple[int, str | None, dict],
              e: BaseException) -> CheckpointWriteError:
    # The save's other threads may wait for a step directory that will
    # never come (until orbax's 300 s timeout), holding the process at exit.
    release_waiting_threads(pending[1])
    try:
      # Orbax dropped the steps this save was to replace (max_to_keep) from
      # its list; they are still on disk, and still the ones to resume.
      self._manager.reload()
    except Exception:  # pylint: disable=broad-except
      pass
    return self._write_error(pending[0], e, "failed in the background")

  def _write_error(self, step: int, e: BaseException,
                   what: str) -> CheckpointWriteError:
    return CheckpointWriteError(
        f"saving the checkpoint of step {step} in {self.directory!r} {what}"
        f" ({type(e).__name__}: {e}). The checkpoints committed before are "
        f"intact (kept: {self.all_steps()}). Free space or fix the "
        "directory's permissions and save again, or save to another "
        "directory.", step, self.directory)

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ------------------------------------------------------------- restore

  def latest_step(self) -> int | None:
    """The step of the newest complete checkpoint, or None if there is
    none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def all_steps(self) -> list[int]:
    """The steps of every complete checkpoint kept, oldest first.

    Only committed zero_jax checkpoints count: a step's directory that
    orbax never committed, or that zero_jax did not write, is left out.
    """
    return [s for s in sorted(self._manager.all_steps())
            if self._is_committed(s)]

  def _step_path(self, step: int) -> epath.Path:
    return self._root / str(step)

  def _forget_if_gone(self) -> None:
    """Forgets the last checkpoint (a failed step names) if it is gone."""
    last = _last_checkpoint.last()
    if last is not None and last.directory == self.directory:
      self._committed.discard(last.step)
      if not self._is_committed(last.step):
        _last_checkpoint.forget(self.directory)

  def _is_committed(self, step: int) -> bool:
    """Whether the directory of ``step`` is a finished zero_jax checkpoint:
    orbax's commit marker (``commit_success.txt``, or, from orbax versions
    that commit by the rename alone, the commit time in its step metadata)
    and zero_jax's own items. A committed checkpoint never changes, so the
    answer is kept."""
    if step in self._committed:
      return True
    path = self._step_path(step)
    try:
      ok = ((path / "meta" / "metadata").exists() and
            (path / "state").is_dir() and
            ((path / COMMIT_FILE).exists() or commit_time(path)))
    except OSError:  # unreadable: not a checkpoint to restore
      ok = False
    if ok:
      self._committed.add(step)
    return ok

  def restore(self, engine: Engine, params: Any, *,
              step: int | None = None) -> TrainState:
    """Restores a checkpoint into ``engine``'s layout.

    The checkpoint may come from any stage, device count, mesh or offload
    setting: each device reads its own shard of every array from disk.

    Args:
      engine: the engine to continue training with.
      params: the parameters as given to ``engine.init``, or only their
        structure (``jax.ShapeDtypeStruct`` leaves, e.g. from
        ``jax.eval_shape``): used for the tree and shapes, never read.
      step: which checkpoint; default the latest complete one.

    Returns:
      The ``TrainState``, as if training had never stopped.

    Raises:
      FileNotFoundError: no checkpoint (of that step) in the directory.
      ValueError: the checkpoint's tree, shapes or dtypes differ from this
        model and optimizer; the message names the first differing leaf.
    """
    self._check_open("restore")
    step = self._resolve_step(step)
    target = engine.abstract_state(params)
    state, meta = self._reader.read(step, target)
    self._reader.verify(step, meta, state, target)
    if not self.read_only:
      # A new run continues this checkpoint: its first save moves the steps
      # after it (of the history left behind) aside.
      _lineage.continue_from(self._key, _lineage.run_of(meta), step,
                             agreed_id())
    _last_checkpoint.record(self.directory, step)
    return engine.complete_state(state)

  def _resolve_step(self, step: int | None) -> int:
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(
            f"no complete checkpoint in {self.directory!r}; start with "
            "engine.init(params) (check latest_step() is not None first)")
      return steps[-1]
    if step not in steps:
      if step in self._manager.all_steps():
        raise FileNotFoundError(
            f"{str(self._step_path(step))!r} is not a committed zero_jax "
            "checkpoint (an interrupted save or a foreign directory: no "
            f"commit marker or no zero_jax metadata); restore one of {steps}")
      raise FileNotFoundError(f"no checkpoint of step {step} in "
                              f"{self.directory!r}; kept: {steps}")
    return step

  # ----------------------------------------------------------- preemption

  def reached_preemption(self, step: int) -> bool:
    """Whether to save a final checkpoint at ``step`` and exit.

    Single process: true once the process got SIGTERM. Several processes:
    JAX's preemption service (started by ``jax.distributed.initialize``)
    propagates one process's SIGTERM to all and picks the same step for
    every process; call this at every step, on every process.
    """
    polled = self._sigterm.poll()
    if jax.process_count() > 1:
      # pylint: disable-next=g-import-not-at-top
      from jax.experimental import multihost_utils
      return multihost_utils.reached_preemption_sync_point(step)
    return polled


# --------------------------------------------------------------- helpers

def _weakly(method: Callable[[], None]) -> Callable[[], None]:
  """Calls ``method`` while its object lives, without keeping it alive."""
  ref = weakref.WeakMethod(method)

  def call() -> None:
    bound = ref()
    if bound is not None:
      bound()

  return call
