"""What a checkpoint stores of a ``TrainState``, item by item, and the
names orbax gives its leaves."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from zero_jax.checkpoint import _integrity
from zero_jax.train import TrainState

# The parts of the TrainState a checkpoint stores (compute_params is derived).
STORED = ("step", "params", "opt_state", "rng")


def stored_tree(state: TrainState) -> dict[str, Any]:
  """What a checkpoint stores of ``state``, by orbax item."""
  tree = {"state": {k: getattr(state, k) for k in STORED}}
  if state.loss_scale is not None:
    tree["loss_scale"] = ls_dict(state.loss_scale)
  return tree


def names(target: TrainState) -> dict[str, list[str]]:
  """Orbax's names of the stored leaves (``params.w``), by item."""
  return {item: [_integrity.leaf_name(p) for p, _ in
                 jax.tree_util.tree_flatten_with_path(tree)[0]]
          for item, tree in stored_tree(target).items()}


def ls_dict(ls: Any) -> dict[str, Any]:
  """A loss scale's fields, as orbax stores them."""
  return {f.name: getattr(ls, f.name) for f in dataclasses.fields(ls)}
