"""Checks of what the user hands the engine: the state, the batch and what
``loss_fn`` returns. Each raises naming the difference and the fix."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from zero_jax.train._state import TrainState

_CONVERT = ("Convert a state between device counts, stages, offload "
            "settings and compute dtypes by saving it with zj.Checkpointer "
            "and restoring it into this engine (Checkpointer.restore(engine, "
            "params)).")


def _describe_value(x: Any) -> str:
  """``float32[4, 8]`` for an array, else the type's name."""
  if hasattr(x, "dtype") and hasattr(x, "shape"):
    return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"
  return type(x).__name__


def check_state(state: Any, shapes: TrainState, shardings: TrainState,
                live: Callable[[Any], bool] = lambda x: False) -> None:
  """Raises, naming the difference and the fix, unless ``state`` is a
  live ``TrainState`` of this layout.

  Args:
    state: what ``engine.step`` was given.
    shapes: the engine's state as ``jax.ShapeDtypeStruct`` leaves.
    shardings: the engine's state shardings.
    live: whether a numpy leaf is the engine's live host state (the fused
      host optimizer's buffers, updated in place).
  """
  if not isinstance(state, TrainState):
    raise TypeError(
        "engine.step takes the TrainState of engine.init, of the previous "
        "step or of Checkpointer.restore; got "
        f"{type(state).__name__}")
  for part in ("params", "opt_state", "compute_params", "loss_scale",
               "step", "rng"):
    got, want = getattr(state, part), getattr(shapes, part)
    part_shardings = getattr(shardings, part)
    got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(got)
    if got_tree != jax.tree.structure(want):
      raise ValueError(
          f"state.{part} does not have this engine's tree (it has "
          f"{len(got_leaves)} leaves, this engine's has "
          f"{len(jax.tree.leaves(want))}): the state comes from an engine "
          "with another model, optimizer, compute_dtype or loss scaling. "
          + _CONVERT + " A state of another model or optimizer cannot be "
          "converted.")
    for (path, x), w, sh in zip(got_leaves, jax.tree.leaves(want),
                                jax.tree.leaves(part_shardings)):
      where = f"state.{part}{jax.tree_util.keystr(path)}"
      if isinstance(x, np.ndarray) and part in ("params", "opt_state"):
        if not live(x):
          raise ValueError(
              f"{where} is host state an earlier engine.step updated in "
              "place: this TrainState was donated to that step, which "
              "returned the state to use instead (state, metrics = "
              "engine.step(state, batch)); to go back to an earlier step, "
              "restore its checkpoint")
        continue
      if not isinstance(x, jax.Array):
        raise TypeError(f"{where} is a {type(x).__name__}, not a jax.Array:"
                        " pass the state engine.init or engine.step "
                        "returned")
      if x.is_deleted():
        raise ValueError(
            f"{where} was deleted: this TrainState was donated to an "
            "earlier engine.step, which returned the state to use "
            "instead (state, metrics = engine.step(state, batch)); if "
            "that step failed, its state is gone too: restore the last "
            "checkpoint (zero_jax.Checkpointer(directory).restore(engine, "
            "params)) or start again with engine.init(params).")
      if x.shape != w.shape or x.dtype != w.dtype:
        raise ValueError(
            f"{where} is {_describe_value(x)}, this engine's is "
            f"{_describe_value(w)}: the state comes from another model or "
            "engine. " + _CONVERT)
      if (not x.sharding.is_equivalent_to(sh, x.ndim) or
          (x.sharding.memory_kind or "device") !=
          (sh.memory_kind or "device")):
        raise ValueError(
            f"{where} is laid out on {len(x.sharding.device_set)} "
            f"device(s) ({x.sharding}); this engine lays it out on "
            f"{len(sh.device_set)} ({sh}): the state comes from an "
            "engine with another mesh, stage or offload setting. "
            + _CONVERT)


def check_batch(batch: Any) -> None:
  """Raises unless every batch leaf has one and the same leading
  (example) dimension, not zero."""
  leaves = jax.tree_util.tree_leaves_with_path(batch)
  if not leaves:
    raise ValueError("the batch holds no arrays: pass a pytree of arrays "
                     "whose leading dimension is the examples")
  sizes = {}
  for path, x in leaves:
    shape = np.shape(x)
    if not shape:
      raise ValueError(
          f"batch leaf {jax.tree_util.keystr(path) or 'batch'} is a "
          "scalar; batch leaves need a leading batch dimension")
    sizes[jax.tree_util.keystr(path) or "batch"] = shape[0]
  if len(set(sizes.values())) > 1:
    raise ValueError(
        "batch leaves have different leading (example) dimensions: "
        + ", ".join(f"{k}: {v}" for k, v in sizes.items())
        + "; every leaf must hold the same examples, one row each")
  if not next(iter(sizes.values())):
    raise ValueError("the batch has 0 examples; pass at least one example "
                     "per device")


def split_loss(out: Any, has_aux: bool) -> tuple[Any, Any]:
  """``(loss, aux)`` from what ``loss_fn`` returned, or a TypeError that
  names what it returned and ``has_aux``."""
  pair = isinstance(out, (tuple, list)) and len(out) == 2
  if has_aux and not pair:
    raise TypeError(
        f"loss_fn returned {_describe_value(out)}, but the Engine has "
        "has_aux=True: return (loss, aux), or pass has_aux=False")
  if not has_aux and isinstance(out, (tuple, list)):
    raise TypeError(
        f"loss_fn returned a {type(out).__name__} of {len(out)}: return "
        "the scalar loss, or pass has_aux=True to return (loss, aux)")
  loss, aux = out if has_aux else (out, None)
  dtype = getattr(loss, "dtype", None)
  if (isinstance(loss, (bool, int)) or dtype is None or
      not jnp.issubdtype(dtype, jnp.floating) or np.shape(loss) != ()):
    raise TypeError(
        f"loss_fn must return a floating-point scalar (the mean loss over "
        f"its examples); it returned {_describe_value(loss)}"
        + ("" if has_aux else " (with has_aux=False)")
        + ". An integer or bool loss has no gradient: compute it in "
        "floating point from the parameters.")
  return loss, aux
