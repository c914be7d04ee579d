"""Whether a checkpoint fits a model and optimizer, and why not.

The checks ``Checkpointer.restore`` and ``load_params`` run before orbax
reads anything: they compare the stored tree's metadata with the target's,
leaf by leaf, and name the first difference (a missing leaf, a shape, a
dtype, an optimizer whose state is shaped differently).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zero_jax._paths import key_name


def _flat(tree: Any) -> dict[tuple[str, ...], Any]:
  """Leaves by a path of plain strings: a namedtuple field, a dict key and
  a list index read the same in a live tree and in orbax's metadata."""
  return {tuple(key_name(k) for k in path): leaf for path, leaf in
          jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_matches(target: Any, stored: Any, part: str, where: str,
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
      was = meta.get("opt_state") or outline(stored)
      raise ValueError(
          f"{where}{saved_as} holds the state of another optimizer than "
          f"this engine's: {what}. The checkpoint's optimizer state is "
          f"{was}; this engine's is {outline(target)}. Restore with the "
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
  return [tuple(key_name(k) for k in path) for path, leaf in
          jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_empty)[0]
          if _is_empty(leaf)]


def outline(tree: Any, depth: int = 1) -> str:
  """A short picture of a tree's top levels, e.g. of an optimizer state:
  ``(ScaleByAdamState(count, mu, nu), EmptyState())``; orbax's metadata of
  the same state reads ``[{count, mu, nu}, None]``."""
  if _is_empty(tree):
    return "None" if tree is None else f"{type(tree).__name__}()"
  children = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: x is not tree)[0]
  if len(children) == 1 and children[0][0] == ():
    return "array"
  keys = [key_name(path[0]) for path, _ in children]
  if depth <= 0:
    parts = keys
  elif isinstance(tree, dict):
    parts = [f"{k}: {outline(c, depth - 1)}"
             for k, (_, c) in zip(keys, children)]
  else:
    parts = [outline(c, depth - 1) for _, c in children]
  inner = ", ".join(parts)
  if type(tree) in (tuple, list):
    return f"({inner})" if type(tree) is tuple else f"[{inner}]"
  if isinstance(tree, dict):
    return "{" + inner + "}"
  return f"{type(tree).__name__}({inner})"
