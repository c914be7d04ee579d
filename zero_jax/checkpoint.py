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
import functools
import os
import signal
import threading
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from zero_jax import loss_scale as _ls
from zero_jax.engine import Engine, TrainState

# The parts of the TrainState a checkpoint stores (compute_params is derived).
_STORED = ("step", "params", "opt_state", "rng")


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
  """

  def __init__(self, directory: str | os.PathLike, *,
               max_to_keep: int | None = 3, async_save: bool = True,
               handle_sigterm: bool = True):
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
    self.directory = os.fspath(directory)
    self._manager = ocp.CheckpointManager(
        os.path.abspath(self.directory) if "://" not in self.directory
        else self.directory,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "loss_scale": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
            create=True))
    self._sigterm = threading.Event()
    self._polled = False
    self._previous_handler = None
    self._installed = False
    if (handle_sigterm and jax.process_count() == 1 and
        threading.current_thread() is threading.main_thread()):
      self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
      self._installed = True

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
    """
    step = int(state.step)
    if step in self._manager.all_steps():
      return False  # (e.g. a periodic save and a preemption save coincide)
    items = {"state": ocp.args.StandardSave(
        {k: getattr(state, k) for k in _STORED})}
    if state.loss_scale is not None:
      items["loss_scale"] = ocp.args.StandardSave(_ls_dict(state.loss_scale))
    meta = {"format": 1, "step": step,
            "num_devices": jax.device_count(),
            "process_count": jax.process_count()}
    if engine is not None:
      # (JSON: tuples become lists.)
      meta["config"] = dataclasses.asdict(engine.config)
    return self._manager.save(step, args=ocp.args.Composite(
        meta=ocp.args.JsonSave(meta), **items))

  def wait(self) -> None:
    """Blocks until the last asynchronous save is committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the directory."""
    self._manager.close()
    if self._installed:
      signal.signal(signal.SIGTERM, self._previous_handler or signal.SIG_DFL)
      self._installed = False

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ------------------------------------------------------------- restore

  def latest_step(self) -> int | None:
    """The step of the newest complete checkpoint, or None if there is
    none."""
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """The steps of every complete checkpoint kept, oldest first."""
    return sorted(self._manager.all_steps())

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
    # A float16 run resumed from a checkpoint without a loss scale starts a
    # fresh one; a loss scale is dropped when resuming without float16.
    if target.loss_scale is not None and has_scale:
      items["loss_scale"] = ocp.args.StandardRestore(
          _ls_dict(target.loss_scale))
    try:
      r = self._manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # orbax raises many types; say which checkpoint
      raise self._unreadable(step, e) from e
    state = TrainState(**r["state"],
                       loss_scale=(_ls.LossScaleState(**r["loss_scale"])
                                   if "loss_scale" in items else None))
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
  metadata) and ``target`` differ in presence, shape or dtype."""
  saved_as = ""
  if meta.get("config"):
    c = meta["config"]
    saved_as = (f" (saved at stage {c.get('stage')} on "
                f"{meta.get('num_devices')} device(s))")

  def fail(what: str) -> None:
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


__all__ = ["Checkpointer", "export_params", "load_params"]
