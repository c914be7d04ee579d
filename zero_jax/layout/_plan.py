"""Layout planning: which dimension of each leaf is split over ``data``.

A leaf's layout depends only on its shape, the device count and the config,
so parameters, gradients and every optimizer-state leaf that mirrors a
parameter (Adam's moments, momentum) get the same layout without having to
know which optimizer produced them. Leaves that cannot or should not be split
(scalars, no dimension divisible by the device count, fewer elements than
``min_shard_elements``, or any leaf at stage 0) are replicated, and the
reason is kept so ``describe`` can report it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zero_jax._paths import path_str
from zero_jax.layout._mesh import DATA, layout_mesh


@dataclasses.dataclass(frozen=True)
class LeafPlan:
  """Layout of one array.

  Attributes:
    shape: the global shape.
    dim: the dimension split over ``data``, or None when replicated.
    reason: why the leaf is replicated ("" when sharded).
  """

  shape: tuple[int, ...]
  dim: int | None
  reason: str = ""

  @property
  def sharded(self) -> bool:
    """Whether the leaf is split over ``data``."""
    return self.dim is not None

  @property
  def spec(self) -> P:
    """The leaf's ``PartitionSpec``."""
    if self.dim is None:
      return P()
    return P(*([None] * self.dim + [DATA]))

  def local_shape(self, n: int) -> tuple[int, ...]:
    """The shape each of ``n`` devices holds."""
    if self.dim is None:
      return self.shape
    s = list(self.shape)
    s[self.dim] //= n
    return tuple(s)


def is_plan(x: Any) -> bool:
  """Whether ``x`` is a ``LeafPlan`` (the ``is_leaf`` of trees of plans)."""
  return isinstance(x, LeafPlan)


def map_leaves(fn: Callable[..., Any], plans: Any, *trees: Any) -> Any:
  """``jax.tree.map(fn, plans, *trees)`` with each ``LeafPlan`` a leaf."""
  return jax.tree.map(fn, plans, *trees, is_leaf=is_plan)


def flat(plans: Any) -> list[LeafPlan]:
  """The ``LeafPlan`` leaves of a tree of plans, in tree order."""
  return jax.tree.leaves(plans, is_leaf=is_plan)


def plan_leaf(shape: tuple[int, ...], n: int, stage: int,
              min_shard_elements: int) -> LeafPlan:
  """Chooses the layout of one array.

  The largest dimension divisible by ``n`` is split (ties go to the later
  dimension, which for stacked ``(layers, ...)`` weights keeps the layer axis
  whole, so a scan can slice one layer without gathering others).

  Args:
    shape: global shape of the leaf.
    n: devices on the ``data`` axis.
    stage: ZeRO stage; stage 0 replicates everything.
    min_shard_elements: smaller leaves are replicated.

  Returns:
    The leaf's plan.
  """
  shape = tuple(int(d) for d in shape)
  if stage == 0:
    return LeafPlan(shape, None, "stage 0")
  if not shape:
    return LeafPlan(shape, None, "scalar")
  size = math.prod(shape)
  if size < min_shard_elements:
    return LeafPlan(
        shape, None,
        f"{size} elements < min_shard_elements={min_shard_elements}")
  best = None
  for d, extent in enumerate(shape):
    if extent % n == 0 and extent >= n and (best is None or
                                            extent >= shape[best]):
      best = d
  if best is None:
    return LeafPlan(shape, None, f"no dimension divisible by {n}")
  return LeafPlan(shape, best)


class Plan:
  """Layouts for a whole pytree (parameters or optimizer state).

  Attributes:
    mesh: the mesh.
    leaves: a pytree, same structure as the planned tree, of ``LeafPlan``.
  """

  def __init__(self, tree: Any, mesh: Mesh, stage: int,
               min_shard_elements: int):
    self.mesh = mesh
    self.n = mesh.shape[DATA]
    self.leaves = jax.tree.map(
        lambda x: plan_leaf(np.shape(x), self.n, stage, min_shard_elements),
        tree)

  def _map(self, fn):
    return map_leaves(fn, self.leaves)

  @property
  def specs(self) -> Any:
    """PartitionSpecs of the sharded layout."""
    return self._map(lambda lp: lp.spec)

  @property
  def shardings(self) -> Any:
    """NamedShardings of the sharded layout."""
    mesh = layout_mesh(self.mesh)
    return self._map(lambda lp: NamedSharding(mesh, lp.spec))

  @property
  def replicated_specs(self) -> Any:
    """PartitionSpecs of the replicated layout (``P()`` everywhere)."""
    return self._map(lambda lp: P())

  @property
  def replicated_elements(self) -> int:
    """Elements of the leaves kept replicated (small or indivisible)."""
    return sum(math.prod(lp.shape) for _, lp in self.rows() if not lp.sharded)

  def rows(self) -> list[tuple[str, LeafPlan]]:
    """(path, plan) for every leaf, in tree order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(self.leaves,
                                                   is_leaf=is_plan)
    return [(path_str(p), lp) for p, lp in flat]
