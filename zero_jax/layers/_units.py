"""The repeated blocks of a parameter tree: the units the engine runs one
at a time.

Most models call their blocks one after another (``for block in
self.blocks: x = block(x)``), and their parameter trees show it: sibling
subtrees with identical structure, shapes and dtypes (``blocks/0``,
``blocks/1``, ... of an NNX list; ``Block_0``, ``Block_1``, ... of Linen;
``layers/3`` of a plain dict). ``find_units`` finds them once, when the
engine lays out the parameters (``ZeroConfig.layer_classes=None``); while
the step is traced, a Flax module call whose parameters are exactly one of
them runs as a unit (``zero_jax.layers._intercept``), and
``describe_units`` reports both for ``Engine.describe()``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from zero_jax._paths import key_name


@dataclasses.dataclass(frozen=True)
class Unit:
  """One repeated block found in the parameter tree.

  Attributes:
    path: the path of its parameter subtree, e.g. ``"blocks/3"``.
    leaves: the flat indices of its parameter leaves.
    size: its parameter count.
  """

  path: str
  leaves: frozenset[int]
  size: int


def find_units(params: Any) -> tuple[Unit, ...]:
  """The repeated blocks of a parameter tree.

  Under one parent, two or more children whose subtrees have the same
  structure, shapes and dtypes. The outermost such children win (a block's
  own repeated parts stay inside it).

  Args:
    params: the parameter tree (arrays or anything with a shape and dtype).

  Returns:
    The units, in the order of the flattened tree's levels, outermost
    first.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  keys = [tuple(key_name(k) for k in path) for path, _ in flat]
  signature = [(tuple(np.shape(x)), str(getattr(x, "dtype", ""))) for _, x in
               flat]
  units, taken = [], set()
  depth = max((len(k) for k in keys), default=0)
  for level in range(1, depth):
    # Children at this level, grouped by parent: {parent: {child: leaves}}.
    groups: dict[tuple, dict[str, list[int]]] = {}
    for i, k in enumerate(keys):
      # (A child must be a subtree: a norm's bias and scale are no blocks.)
      if len(k) > level + 1 and i not in taken:
        groups.setdefault(k[:level - 1], {}).setdefault(k[level - 1],
                                                        []).append(i)
    for parent, children in groups.items():
      by_shape: dict[tuple, list[str]] = {}
      for child, leaves in children.items():
        shape = tuple((keys[i][level:], signature[i]) for i in leaves)
        by_shape.setdefault(shape, []).append(child)
      for same in by_shape.values():
        if len(same) < 2:
          continue
        for child in same:
          leaves = children[child]
          taken.update(leaves)
          units.append(Unit(
              "/".join((*parent, child)), frozenset(leaves),
              int(sum(int(np.prod(signature[i][0])) for i in leaves))))
  return tuple(units)


def describe_units(units: tuple[Unit, ...], seen: dict[str, int], stage: int,
                   layer_classes: tuple[str, ...] | None) -> list[str]:
  """``Engine.describe()``'s lines on the blocks.

  Args:
    units: the repeated blocks of the parameter tree (``find_units``).
    seen: the blocks run as units while the step was traced,
      ``{name: calls}``.
    stage: the ZeRO stage (below 2 nothing runs per block).
    layer_classes: ``ZeroConfig.layer_classes``.

  Returns:
    The lines, without line breaks.
  """
  if stage < 2:
    return []
  if layer_classes == ():
    return ["blocks: off (layer_classes=()); only scan_layers runs per "
            "layer"]
  lines = []
  if layer_classes is None and units:
    sizes = sorted({u.size for u in units})
    lines.append(f"repeated blocks in the parameter tree: {len(units)} "
                 f"({units[0].path} ... {units[-1].path}; "
                 f"{', '.join(f'{s:,}' for s in sizes)} parameters each)")
  elif layer_classes is None:
    lines.append("repeated blocks in the parameter tree: none")
  if seen:
    lines.append("run one at a time (gathered at the call, reduce-scattered "
                 "as backward leaves them): " + ", ".join(
                     f"{n} x{c}" for n, c in sorted(seen.items())))
  elif units or layer_classes:
    lines.append("blocks run one at a time: known once the step is traced "
                 "(after the first step, or engine.step.lower)")
  return lines
