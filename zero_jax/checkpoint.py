"""Checkpoints with orbax that restore into any stage, mesh and offload.

A checkpoint holds the *logical* train state: the fp32 master parameters
and the optimizer state as whole arrays (each written as its shards by the
process that owns them; nothing is gathered), the step, the rng key and the
float16 loss scale. Layout is not part of it: restoring builds the target
layout from the engine it is restored into (any stage, device count, mesh,
offload) and orbax reads each device's shard of it straight from disk. So a
checkpoint saved at stage 3 on 8 devices restores at stage 1 on 4, or at
stage 0 on one, with no conversion step. The compute-dtype copy is not
stored: it is a cast of the master, redone on restore.

    ckpt = zj.Checkpointer("ckpt", max_to_keep=3)
    state = (ckpt.restore(engine, params) if ckpt.latest_step() is not None
             else engine.init(params))
    for batch in data:
      state, metrics = engine.step(state, batch)
      step = int(state.step)
      if step % 100 == 0 or ckpt.reached_preemption(step):
        ckpt.save(state)                # async: returns once copied off
      if ckpt.reached_preemption(step):
        break                           # SIGTERM: saved, now exit
    ckpt.close()                        # waits for the last save

``export_params`` writes the parameters alone as a plain orbax checkpoint in
the structure given to ``Engine.init``, which Flax code loads without
zero_jax; ``load_params`` reads such a checkpoint back, already sharded, to
start training with a fresh optimizer.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import signal
import sys
import tempfile
import threading
import weakref
from typing import Any

from etils import epath
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from zero_jax import loss_scale as _ls
from zero_jax.engine import Engine, TrainState

# The parts of the TrainState a checkpoint stores (compute_params is derived).
_STORED = ("step", "params", "opt_state", "rng")


class CheckpointWriteError(OSError):
  """Saving a checkpoint failed; the checkpoints committed before are intact.

  Raised by ``Checkpointer.save`` when the directory cannot take the
  checkpoint, and by the next ``save``, ``wait`` or ``close`` when an
  asynchronous save failed in the background (a full disk, a lost
  permission, a file system error). ``step`` and ``directory`` say which
  save; ``__cause__`` is the error underneath.
  """

  def __init__(self, message: str, step: int, directory: str):
    super().__init__(message)
    self.step = step
    self.directory = directory


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

  Raises:
    OSError: a local ``directory`` is a file, or cannot be created or
      written (``NotADirectoryError``, ``PermissionError``, ...); the
      message names the path and the fix.
  """

  def __init__(self, directory: str | os.PathLike, *,
               max_to_keep: int | None = 3, async_save: bool = True,
               handle_sigterm: bool = True):
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
    self.directory = os.fspath(directory)
    self._local = "://" not in self.directory
    if self._local:
      # Orbax would accept a file or an unwritable path here and fail only
      # in its background threads, which then keep the process alive.
      _check_usable(self.directory)
    self._manager = ocp.CheckpointManager(
        os.path.abspath(self.directory) if self._local else self.directory,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "loss_scale": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
            create=True))
    self._root = epath.Path(self._manager.directory)
    self._pending: tuple[int, str | None] | None = None  # (step, operation)
    self._committed: set[int] = set()  # steps verified on disk
    self._max_to_keep = max_to_keep
    self._check_no_strays()
    self._sigterm = threading.Event()
    self._polled = False
    _at_thread_shutdown(self)
    self._previous_handler = None
    self._installed = False
    if (handle_sigterm and jax.process_count() == 1 and
        threading.current_thread() is threading.main_thread()):
      self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
      self._installed = True

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

  def _on_sigterm(self, signum, frame) -> None:
    # Deferred only for a loop that asks (reached_preemption); otherwise,
    # or on a second SIGTERM, the process terminates as it would have.
    if self._polled and not self._sigterm.is_set():
      self._sigterm.set()
      return
    previous = self._previous_handler
    if callable(previous):
      previous(signum, frame)
      return
    signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)

  # ---------------------------------------------------------------- save

  def save(self, state: TrainState, *,
           engine: Engine | None = None) -> bool:
    """Saves ``state`` as the checkpoint of step ``state.step``.

    Args:
      state: the train state (not consumed: keep training with it).
      engine: the engine that made it; if given, its config is recorded in
        the checkpoint's metadata (shown when a restore fails).

    Returns:
      True if a checkpoint was started, False if this step has one already.

    Raises:
      CheckpointWriteError: the previous asynchronous save failed (nothing
        of this step is started then), or the directory cannot take this
        one. The checkpoints committed before are intact.
      FileExistsError: the directory of this step exists but is not a
        committed zero_jax checkpoint.
    """
    step = int(state.step)
    # (E.g. a periodic save and a preemption save coincide.)
    if self._pending is not None and self._pending[0] == step:
      return False  # being saved
    self._finish()  # (orbax would wait for the previous save here anyway)
    self._check_no_strays()
    if step in self._manager.all_steps():
      if self._is_committed(step):
        return False
      raise FileExistsError(
          f"{str(self._step_path(step))!r} exists but is not a committed "
          "zero_jax checkpoint (an interrupted save or a foreign directory); "
          "move or delete it, then save again")
    if self._local:
      try:
        _check_usable(self.directory)
      except OSError as e:
        raise self._write_error(step, e, "could not start") from e
    items = {"state": ocp.args.StandardSave(
        {k: getattr(state, k) for k in _STORED})}
    if state.loss_scale is not None:
      items["loss_scale"] = ocp.args.StandardSave(_ls_dict(state.loss_scale))
    meta = {"format": 1, "step": step,
            "num_devices": jax.device_count(),
            "process_count": jax.process_count(),
            "opt_state": _outline(state.opt_state)}
    if engine is not None:
      # (JSON: tuples become lists.)
      meta["config"] = dataclasses.asdict(engine.config)
    try:
      started = self._manager.save(step, args=ocp.args.Composite(
          meta=ocp.args.JsonSave(meta), **items))
    except (OSError, ValueError) as e:  # (orbax's "could not create")
      _release_orbax_threads(_operation_id())
      raise self._write_error(step, e, "failed") from e
    if started:
      self._pending = (step, _operation_id())
    return started

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

  def _release(self, quiet: bool) -> None:
    try:
      self._manager.close()
    except Exception:  # pylint: disable=broad-except
      if not quiet:
        raise
    finally:
      if self._installed:
        signal.signal(signal.SIGTERM, self._previous_handler or signal.SIG_DFL)
        self._installed = False

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

  def _failed(self, pending: tuple[int, str | None],
              e: BaseException) -> CheckpointWriteError:
    # The save's other threads may wait for a step directory that will
    # never come (until orbax's 300 s timeout), holding the process at exit.
    _release_orbax_threads(pending[1])
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

    Only committed zero_jax checkpoints count: a directory named like a
    step that orbax never committed, or that zero_jax did not write, is
    left out.
    """
    return [s for s in sorted(self._manager.all_steps())
            if self._is_committed(s)]

  def _step_path(self, step: int) -> epath.Path:
    return self._root / str(step)

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
            ((path / _COMMIT_FILE).exists() or _commit_time(path)))
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
    step = self._resolve_step(step)
    target = engine.abstract_state(params)
    stored, has_scale = self._stored_metadata(step)
    tree = {k: getattr(target, k) for k in _STORED}
    meta = self._meta(step)
    for part in _STORED:
      _check_matches(tree[part], stored.get(part), part, self._where(step),
                     meta)
    items = {"state": ocp.args.StandardRestore(tree)}
    # A run resumed from a checkpoint without a loss scale (or skip count)
    # starts a fresh one.
    if target.loss_scale is not None and has_scale:
      items["loss_scale"] = ocp.args.StandardRestore(
          _ls_dict(target.loss_scale))
    try:
      r = self._manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # orbax raises many types; say which checkpoint
      if "tree structures do not match" in str(e):
        # A difference the checks above missed is still not corruption.
        raise ValueError(
            f"{self._where(step)} does not match this model and optimizer "
            f"({e}); restore with the model and optimizer it was saved with "
            "(the stage, mesh and offload may differ)") from e
      raise self._unreadable(step, e) from e
    loss_scale = None
    if "loss_scale" in items:
      loss_scale = _ls.LossScaleState(**r["loss_scale"])
      saved_fp16 = int(loss_scale.hysteresis) > 0  # (0: a skip count only)
      if engine.config.compute_dtype != "float16" or not saved_fp16:
        # Only a float16 run's scale is a loss scale (elsewhere it stays 1):
        # the skip count carries over, the scale starts afresh.
        loss_scale = dataclasses.replace(
            jax.device_put(_ls.init(engine.config), loss_scale.skipped.sharding),
            skipped=loss_scale.skipped)
    state = TrainState(**r["state"], loss_scale=loss_scale)
    return engine._complete(state)  # pylint: disable=protected-access

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

  def _where(self, step: int) -> str:
    return f"checkpoint of step {step} in {self.directory!r}"

  def _unreadable(self, step: int, e: Exception) -> ValueError:
    return ValueError(
        f"could not read {self._where(step)} ({type(e).__name__}: {e}); it "
        "is corrupt or not a zero_jax checkpoint: restore an earlier one "
        f"with step= (kept: {self.all_steps()})")

  def _stored_metadata(self, step: int) -> tuple[dict[str, Any], bool]:
    """The stored state's tree of array metadata, and whether the
    checkpoint has a loss scale."""
    try:
      items = self._manager.item_metadata(step)
      md = items["state"]
    except Exception as e:  # a missing or unreadable metadata file
      raise self._unreadable(step, e) from e
    if md is None:
      raise ValueError(f"{self._where(step)} has no 'state' item; it is not "
                       "a zero_jax checkpoint")
    return (dict(getattr(md, "tree", md)),
            items.get("loss_scale") is not None)

  def _meta(self, step: int) -> dict[str, Any]:
    try:
      return self._manager.restore(step, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore()))["meta"] or {}
    except Exception:  # metadata is informative only
      return {}

  # ----------------------------------------------------------- preemption

  def reached_preemption(self, step: int) -> bool:
    """Whether to save a final checkpoint at ``step`` and exit.

    Single process: true once the process got SIGTERM. Several processes:
    JAX's preemption service (started by ``jax.distributed.initialize``)
    propagates one process's SIGTERM to all and picks the same step for
    every process; call this at every step, on every process.
    """
    self._polled = True
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      return multihost_utils.reached_preemption_sync_point(step)
    return self._sigterm.is_set()


# ------------------------------------------------------------------ export

def export_params(engine: Engine, state: TrainState,
                  directory: str | os.PathLike, *,
                  dtype: Any = jnp.float32) -> None:
  """Writes the parameters alone as a plain orbax checkpoint.

  The checkpoint holds one whole array per parameter, in the tree given to
  ``Engine.init``: plain JAX/Flax code loads it with
  ``orbax.checkpoint.StandardCheckpointer().restore(directory)`` (add a
  target to place it on any devices). Each process writes only the shards
  its devices hold, so no host ever holds the whole model.

  Args:
    engine: the engine ``state`` belongs to.
    state: the train state.
    directory: a new directory (it must not exist).
    dtype: the saved dtype, e.g. ``jnp.float32`` or ``jnp.bfloat16``; None
      keeps the dtypes given to ``Engine.init``.
  """
  directory = os.path.abspath(os.fspath(directory))
  if os.path.exists(directory):
    raise FileExistsError(f"{directory!r} exists; export to a new directory")
  dtypes = engine._dtypes  # pylint: disable=protected-access
  shards = engine.param_plan.shardings  # device memory, this engine's layout
  out = []
  for x, dt, sh in zip(jax.tree.leaves(state.params), dtypes,
                       jax.tree.leaves(shards)):
    # One leaf at a time, in the sharded layout (a replicated master is
    # sliced, an offloaded one copied to the device), cast shard by shard.
    out.append(_cast(jax.device_put(x, sh),
                     jnp.dtype(dt if dtype is None else dtype)))
  tree = jax.tree.unflatten(jax.tree.structure(state.params), out)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(directory, tree)
  ckptr.wait_until_finished()
  ckptr.close()


def load_params(directory: str | os.PathLike, engine: Engine,
                params: Any) -> Any:
  """Reads a parameters-only checkpoint, already in ``engine``'s layout.

  The checkpoint is one from ``export_params`` or any orbax checkpoint of a
  parameter tree with the same structure (e.g. saved by plain Flax code).
  Pass the result to ``engine.init`` to train from it with a fresh
  optimizer state; each device reads only its shard.

  Args:
    directory: the checkpoint.
    engine: the engine that will train.
    params: the tree of shapes and dtypes (arrays or
      ``jax.ShapeDtypeStruct`` s) given to ``engine.init``.

  Returns:
    The parameters in the dtypes of ``params``, sharded as ``engine``
    shards its master copy.

  Raises:
    ValueError: the checkpoint's tree or shapes differ; names the first
      differing leaf.
  """
  directory = os.path.abspath(os.fspath(directory))
  engine.abstract_state(params)  # builds the layout
  shards = engine.param_plan.shardings
  target = jax.tree.map(
      lambda p, sh: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=sh),
      params, shards)
  ckptr = ocp.StandardCheckpointer()
  try:
    stored = ckptr.metadata(directory)
  except Exception as e:
    raise ValueError(f"could not read the parameter checkpoint "
                     f"{directory!r}: {e}") from e
  stored = getattr(stored, "item_metadata", stored)
  stored = getattr(stored, "tree", stored)
  _check_matches(target, stored, "params", f"{directory!r}", {},
                 check_dtype=False)
  return ckptr.restore(directory, target)


# --------------------------------------------------------------- helpers

@functools.partial(jax.jit, static_argnums=1)
def _cast(x: jax.Array, dtype: Any) -> jax.Array:
  return x.astype(dtype)


def _ls_dict(ls: Any) -> dict[str, Any]:
  return {f.name: getattr(ls, f.name) for f in dataclasses.fields(ls)}


def _key(entry: Any) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def _flat(tree: Any) -> dict[tuple[str, ...], Any]:
  """Leaves by a path of plain strings: a namedtuple field, a dict key and
  a list index read the same in a live tree and in orbax's metadata."""
  return {tuple(_key(k) for k in path): leaf for path, leaf in
          jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_matches(target: Any, stored: Any, part: str, where: str,
                   meta: dict[str, Any], check_dtype: bool = True) -> None:
  """Raises a ValueError naming the first leaf where ``stored`` (orbax
  metadata) and ``target`` differ in presence, shape or dtype, or else the
  first state-less node (e.g. an optimizer's ``EmptyState``) that only one
  of them has."""
  saved_as = ""
  if meta.get("config"):
    c = meta["config"]
    saved_as = (f" (saved at stage {c.get('stage')} on "
                f"{meta.get('num_devices')} device(s))")

  def fail(what: str) -> None:
    if part == "opt_state" and stored is not None:
      # The model matches (params are checked first): another optimizer.
      was = meta.get("opt_state") or _outline(stored)
      raise ValueError(
          f"{where}{saved_as} holds the state of another optimizer than "
          f"this engine's: {what}. The checkpoint's optimizer state is "
          f"{was}; this engine's is {_outline(target)}. Restore with the "
          "optimizer it was saved with (the stage, mesh and offload may "
          "differ), or, to switch optimizers, restore with it and start "
          "this engine's optimizer state fresh from the parameters: "
          "engine.init(old_engine.gather_params(state)), or export_params "
          "and load_params for a large model.")
    raise ValueError(
        f"{where}{saved_as} does not match this model and optimizer: {what}."
        " It was saved from a different model, optimizer or parameter tree; "
        "restore with the same ones (the stage, mesh and offload may "
        "differ).")

  if stored is None:
    fail(f"it has no {part!r}")
  want, have = _flat(target), _flat(stored)
  for path, t in want.items():
    name = "/".join((part,) + path)
    if path not in have:
      fail(f"{name} is missing from the checkpoint")
    s = have[path]
    if tuple(s.shape) != tuple(t.shape):
      fail(f"{name} has shape {tuple(s.shape)} in the checkpoint but "
           f"{tuple(t.shape)} here")
    if check_dtype and jnp.dtype(s.dtype) != jnp.dtype(t.dtype):
      fail(f"{name} has dtype {jnp.dtype(s.dtype)} in the checkpoint but "
           f"{jnp.dtype(t.dtype)} here")
  for path in have:
    if path not in want:
      fail(f"{'/'.join((part,) + path)} is in the checkpoint but not in "
           "this model")
  # The same arrays, but e.g. adam's (ScaleByAdamState, EmptyState) against
  # adamw's (ScaleByAdamState, EmptyState, EmptyState): orbax would refuse
  # the tree. A node without arrays is stored as None.
  want, have = _empty_nodes(target), _empty_nodes(stored)
  for path in want:
    if path not in have:
      fail(f"{'/'.join((part,) + path)} (a part without arrays) is missing "
           "from the checkpoint")
  for path in have:
    if path not in want:
      fail(f"{'/'.join((part,) + path)} (a part without arrays) is in the "
           "checkpoint but not here")


def _is_empty(tree: Any) -> bool:
  return not jax.tree_util.tree_leaves(tree)


def _empty_nodes(tree: Any) -> list[tuple[str, ...]]:
  """Paths of the nodes that hold no arrays (``None``, ``EmptyState()``,
  ``()``), in tree order."""
  return [tuple(_key(k) for k in path) for path, leaf in
          jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_empty)[0]
          if _is_empty(leaf)]


def _outline(tree: Any, depth: int = 1) -> str:
  """A short picture of a tree's top levels, e.g. of an optimizer state:
  ``(ScaleByAdamState(count, mu, nu), EmptyState())``; orbax's metadata of
  the same state reads ``[{count, mu, nu}, None]``."""
  if _is_empty(tree):
    return "None" if tree is None else f"{type(tree).__name__}()"
  children = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: x is not tree)[0]
  if len(children) == 1 and children[0][0] == ():
    return "array"
  keys = [_key(path[0]) for path, _ in children]
  if depth <= 0:
    parts = keys
  elif isinstance(tree, dict):
    parts = [f"{k}: {_outline(c, depth - 1)}"
             for k, (_, c) in zip(keys, children)]
  else:
    parts = [_outline(c, depth - 1) for _, c in children]
  inner = ", ".join(parts)
  if type(tree) in (tuple, list):
    return f"({inner})" if type(tree) is tuple else f"[{inner}]"
  if isinstance(tree, dict):
    return "{" + inner + "}"
  return f"{type(tree).__name__}({inner})"


# ------------------------------------------------------- files and threads

# Orbax's commit marker in a step directory (orbax >= 0.11.1 writes it for
# every checkpoint; earlier versions only on file systems without rename).
_COMMIT_FILE = "commit_success.txt"


def _commit_time(path: epath.Path) -> bool:
  """Whether orbax's step metadata records a commit (it is written when a
  checkpoint is finalized, just before the rename that commits it)."""
  try:
    meta = json.loads((path / "_CHECKPOINT_METADATA").read_text())
  except (OSError, ValueError):
    return False
  return bool(isinstance(meta, dict) and meta.get("commit_timestamp_nsecs"))


def _check_usable(directory: str) -> None:
  """Raises an OSError naming the fix unless ``directory`` is, or can be
  made, a directory this process can write into.

  The test writes: permission bits say nothing for root, a read-only mount
  or a full quota.
  """
  path = os.path.abspath(directory)
  if os.path.exists(path) and not os.path.isdir(path):
    raise NotADirectoryError(
        errno.ENOTDIR, f"the checkpoint directory {directory!r} exists and "
        "is not a directory; pass a directory (it is created if missing) or "
        "move the file away")
  try:
    os.makedirs(path, exist_ok=True)
    os.rmdir(tempfile.mkdtemp(prefix=".zero_jax-probe-", dir=path))
  except OSError as e:
    raise OSError(
        e.errno, f"the checkpoint directory {directory!r} cannot be written "
        f"({e.strerror or e}: {e.filename or path}); create it and make it "
        "writable by this process, or pass another directory") from e


def _operation_id() -> str | None:
  """The id orbax gave its latest save (its threads are tagged with it)."""
  try:
    from orbax.checkpoint._src.futures import synchronization  # pylint: disable=g-import-not-at-top
    return synchronization.OperationIdGenerator.get_current_operation_id()
  except Exception:  # pylint: disable=broad-except  # (orbax internals)
    return None


def _release_orbax_threads(operation_id: str | None) -> None:
  """Ends orbax's threads of a failed save that still wait for a signal.

  When the step directory of an asynchronous save cannot be created, the
  threads that write into it keep waiting for its "created" signal until
  orbax's coordination timeout (300 s); they are not daemons, so the
  process cannot exit until then. Cancelled and signalled, they return at
  once. Best effort: this reaches into orbax's internals, and does nothing
  where they differ.
  """
  if operation_id is None:  # (which threads are the save's is unknown)
    return
  try:
    from orbax.checkpoint._src.futures import future  # pylint: disable=g-import-not-at-top
    thread_cls = future._SignalingThread  # pylint: disable=protected-access
  except Exception:  # pylint: disable=broad-except
    return
  for t in threading.enumerate():
    op = getattr(t, "_operation_id", None)
    if (not isinstance(t, thread_cls) or not t.is_alive() or
        op != operation_id):
      continue
    try:
      t.cancel()
      future.set_signals(t._receive_signals, operation_id=op)  # pylint: disable=protected-access
    except Exception:  # pylint: disable=broad-except
      pass


def _at_thread_shutdown(ckpt: Checkpointer) -> None:
  """At interpreter exit, before Python joins the threads, waits for the
  pending save of ``ckpt`` and reports a failure on stderr.

  A program that never calls ``wait`` or ``close`` would otherwise lose a
  failed save's error, and hang in the join if the failure left orbax's
  threads waiting.
  """
  ref = weakref.ref(ckpt)

  def at_exit() -> None:
    c = ref()
    if c is None or c._pending is None:  # pylint: disable=protected-access
      return
    try:
      c._finish()  # pylint: disable=protected-access
    except Exception as e:  # pylint: disable=broad-except
      print(f"zero_jax.Checkpointer at exit: {e}", file=sys.stderr,
            flush=True)

  register = getattr(threading, "_register_atexit", None)  # Python >= 3.9
  if register is not None:
    try:
      register(at_exit)
    except RuntimeError:  # the interpreter is shutting down already
      pass


__all__ = ["CheckpointWriteError", "Checkpointer", "export_params",
           "load_params"]
