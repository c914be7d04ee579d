"""Parameters alone, as a plain orbax checkpoint: out of zero_jax and in.

``export_params`` writes the parameters in the structure given to
``Engine.init``, which Flax code loads without zero_jax; ``load_params``
reads such a checkpoint back, already sharded, to start training with a
fresh optimizer. Both are re-exported by ``zero_jax.checkpoint``.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from zero_jax.checkpoint._matching import check_matches
from zero_jax.materialize._collectives import cast
from zero_jax.train import Engine, TrainState


def export_params(engine: Engine, state: TrainState,
                  directory: str | os.PathLike, *,
                  dtype: Any = jnp.float32, overwrite: bool = False) -> None:
  """Writes the parameters alone as a plain orbax checkpoint.

  The checkpoint holds one whole array per parameter, in the tree given to
  ``Engine.init``, and no record of this engine's devices: plain JAX/Flax
  code loads it on any device count with
  ``orbax.checkpoint.StandardCheckpointer().restore(os.path.abspath(
  directory))`` (whole numpy arrays; orbax takes only absolute paths), or
  with a target of ``jax.ShapeDtypeStruct`` leaves carrying shardings to
  place each leaf on its devices. An ``nnx.State`` needs the target
  (``nnx.state(model, nnx.Param)``): without it orbax returns string keys
  and ``value`` wrappers that ``nnx.update`` rejects. Each process writes
  only the shards its devices hold, so no host ever holds the whole model.

  Args:
    engine: the engine ``state`` belongs to.
    state: the train state.
    directory: a new directory (it must not exist, unless ``overwrite``).
    dtype: the saved dtype, e.g. ``jnp.float32`` or ``jnp.bfloat16``; None
      keeps the dtypes given to ``Engine.init``.
    overwrite: replace an earlier export in ``directory`` (a script run
      again). Only an orbax checkpoint is replaced, never another
      directory.

  Raises:
    FileExistsError: ``directory`` exists (without ``overwrite``, or it is
      no orbax checkpoint).
  """
  directory = os.path.abspath(os.fspath(directory))
  # (orbax's marker of a finished checkpoint: what overwrite may replace.)
  export = os.path.isfile(os.path.join(directory, "_CHECKPOINT_METADATA"))
  if os.path.exists(directory) and not (overwrite and export):
    raise FileExistsError(
        f"{directory!r} exists; export to a new directory" + (
            ", or pass overwrite=True to replace this earlier export"
            if export else " (it is no orbax checkpoint: overwrite=True "
            "replaces only an earlier export)"))
  dtypes = engine.param_dtypes
  shards = engine.param_plan.shardings  # device memory, this engine's layout
  out = []
  for x, dt, sh in zip(jax.tree.leaves(state.params), dtypes,
                       jax.tree.leaves(shards)):
    # One leaf at a time, in the sharded layout (a replicated master is
    # sliced, an offloaded one copied to the device, from each process's own
    # CPU devices where the host updates it), cast shard by shard.
    out.append(_cast(engine.layout.update.to_device(x, sh),
                     jnp.dtype(dt if dtype is None else dtype)))
  tree = jax.tree.unflatten(jax.tree.structure(state.params), out)
  with _unpinned_checkpointer() as ckptr:
    ckptr.save(directory, args=ocp.args.PyTreeSave(tree), force=overwrite)


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
  check_matches(target, stored, "params", f"{directory!r}", {},
                check_dtype=False)
  return ckptr.restore(directory, target)


def _unpinned_checkpointer() -> ocp.Checkpointer:
  """A checkpointer whose arrays record no sharding.

  orbax's default records each array's sharding (the ``_sharding`` file),
  and a restore without a target rebuilds it: on other devices that is
  ``ValueError: Topology mismatch detected``. Without the record, plain
  ``StandardCheckpointer().restore`` returns whole host arrays anywhere,
  and a target's shardings place them; the format is otherwise the
  standard one.
  """
  registry = ocp.type_handlers.create_type_handler_registry(
      (jax.Array,
       ocp.type_handlers.ArrayHandler(enable_write_sharding_file=False)))
  return ocp.Checkpointer(
      ocp.PyTreeCheckpointHandler(type_handler_registry=registry))


# One leaf at a time, cast shard by shard on the devices that hold it.
_cast = jax.jit(cast, static_argnums=1)
