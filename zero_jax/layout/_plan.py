"""Layout planning: which dimension of each leaf is split over ``data``.

With a ``model`` axis (tensor parallelism) the user's model says which
dimensions are split over ``model`` (``zero_jax.layout.model_specs``); ZeRO
then splits one dimension the model leaves free over ``data``, or, where
none divides, one model-split dimension over both (``data`` major).

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
from zero_jax.layout._mesh import DATA, MODEL, REPLICA, layout_mesh

# hpZ (``ZeroConfig.hpz_partition_size``): the primary shards over the
# ``replica`` axis inside ``data`` (``data`` major), so gathering over
# ``replica`` alone gives device ``j`` of a group the ``j``-th contiguous
# block: the group's secondary partition, whose gather stays inside the
# group (a node).
HIERARCHICAL = (DATA, REPLICA)


@dataclasses.dataclass(frozen=True)
class LeafPlan:
  """Layout of one array.

  Attributes:
    shape: the global shape.
    dim: the dimension split over ``data``, or None when replicated.
    reason: why the leaf is replicated ("" when sharded).
    model: per dimension, whether the model splits it over ``model``
      (empty: over no dimension).
    axes: the mesh axes ``dim`` is split over: ``("data",)``, or
      ``HIERARCHICAL`` with hpZ (every batch device holds its own shard).
  """

  shape: tuple[int, ...]
  dim: int | None
  reason: str = ""
  model: tuple[bool, ...] = ()
  axes: tuple[str, ...] = (DATA,)

  @property
  def sharded(self) -> bool:
    """Whether the leaf is split over ``data``."""
    return self.dim is not None

  @property
  def model_split(self) -> bool:
    """Whether the leaf is split over ``model``."""
    return any(self.model)

  @property
  def both(self) -> bool:
    """The ``data`` dimension is also split over ``model`` (``data``
    major): no dimension free of ``model`` divides by the ``data`` axis."""
    return self.dim is not None and self.dim < len(self.model) and \
        self.model[self.dim]

  @property
  def hierarchical(self) -> bool:
    """Split over ``replica`` inside ``data`` (hpZ): gathered over
    ``replica``, then over ``data``."""
    return self.dim is not None and len(self.axes) > 1

  @property
  def spec(self) -> P:
    """The leaf's spec over the batch axes: what ``shard_map`` (manual over
    ``data``, automatic over ``model``) takes."""
    if self.dim is None:
      return P()
    return P(*([None] * self.dim +
               [self.axes if self.hierarchical else DATA]))

  @property
  def model_spec(self) -> P:
    """The leaf's spec over ``model`` alone: its layout replicated over
    ``data``, and the spec of a region manual over ``model``."""
    if not self.model_split:
      return P()
    return P(*[MODEL if m else None for m in self.model])

  @property
  def global_spec(self) -> P:
    """The leaf's whole layout: ``data`` on ``dim``, ``model`` where the
    model splits it (both, ``data`` major, on a shared dimension)."""
    if not self.model_split:
      return self.spec
    entries = list(self.model_spec)
    if self.dim is not None:
      entries[self.dim] = (DATA, MODEL) if self.both else DATA
    return P(*entries)

  def sliced(self) -> "LeafPlan":
    """The plan of one slice along the leading (layer) axis, which is
    split over neither axis."""
    return LeafPlan(self.shape[1:], self.dim - 1, self.reason,
                    self.model[1:], self.axes)

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
              min_shard_elements: int, model: tuple[bool, ...] = (),
              model_size: int = 1, prefer: int | None = None) -> LeafPlan:
  """Chooses the layout of one array.

  The largest dimension divisible by ``n`` that ``model`` leaves free is
  split (ties go to the later dimension, which for stacked ``(layers,
  ...)`` weights keeps the layer axis whole, so a scan can slice one layer
  without gathering others). Where none divides, the largest model-split
  dimension divisible by ``n * model_size`` is split over both axes.

  Args:
    shape: global shape of the leaf.
    n: devices on the ``data`` axis.
    stage: ZeRO stage; stage 0 replicates everything.
    min_shard_elements: smaller leaves are replicated.
    model: per dimension, whether the model splits it over ``model``.
    model_size: devices on the ``model`` axis.
    prefer: a dimension the user's own specs put on ``data``: chosen
      whenever it can be.

  Returns:
    The leaf's plan.
  """
  shape = tuple(int(d) for d in shape)
  model = tuple(bool(m) for m in model) if any(model) else ()
  if stage == 0:
    return LeafPlan(shape, None, "stage 0", model)
  if not shape:
    return LeafPlan(shape, None, "scalar", model)
  size = math.prod(shape)
  if size < min_shard_elements:
    return LeafPlan(
        shape, None,
        f"{size} elements < min_shard_elements={min_shard_elements}", model)
  split = lambda d: d < len(model) and model[d]

  def largest(dims, k):
    best = None
    for d in dims:
      if shape[d] % k == 0 and shape[d] >= k and (best is None or
                                                  shape[d] >= shape[best]):
        best = d
    return best

  free = [d for d in range(len(shape)) if not split(d)]
  best = (prefer if prefer is not None and prefer in free and
          shape[prefer] % n == 0 else largest(free, n))
  if best is None and model:
    best = largest([d for d in range(len(shape)) if split(d)],
                   n * model_size)
  if best is None:
    what = "free of 'model' " if model else ""
    return LeafPlan(shape, None, f"no dimension {what}divisible by {n}",
                    model)
  return LeafPlan(shape, best, "", model)


class Plan:
  """Layouts for a whole pytree (parameters or optimizer state).

  Attributes:
    mesh: the mesh.
    leaves: a pytree, same structure as the planned tree, of ``LeafPlan``.
  """

  def __init__(self, tree: Any, mesh: Mesh, stage: int,
               min_shard_elements: int, model_specs: Any = None,
               hierarchical: bool = False):
    """Plans ``tree``.

    Args:
      tree: arrays or shapes.
      mesh: the mesh.
      stage: ZeRO stage.
      min_shard_elements: smaller leaves are replicated.
      model_specs: for each leaf of ``tree`` in order, one entry per
        dimension: None or the mesh axes it is split over (as
        ``model_specs`` returns); None: no leaf split over ``model``.
      hierarchical: hpZ: split over ``replica`` inside ``data``
        (``HIERARCHICAL``), every batch device holding a shard of its own.
    """
    self.mesh = mesh
    axes = HIERARCHICAL if hierarchical else (DATA,)
    self.n = int(np.prod([mesh.shape[a] for a in axes]))
    m = dict(mesh.shape).get(MODEL, 1)
    leaves, treedef = jax.tree.flatten(tree)
    if model_specs is None:
      model_specs = [()] * len(leaves)

    def plan(x, entries):
      entries = tuple(entries or ())
      on = lambda axis: tuple(e is not None and axis in e for e in entries)
      data = [d for d, yes in enumerate(on(DATA)) if yes]
      lp = plan_leaf(np.shape(x), self.n, stage, min_shard_elements,
                     on(MODEL) if m > 1 else (), m,
                     data[0] if data else None)
      return dataclasses.replace(lp, axes=axes) if lp.sharded else lp

    self.leaves = treedef.unflatten(
        [plan(x, e) for x, e in zip(leaves, model_specs)])

  def _map(self, fn):
    return map_leaves(fn, self.leaves)

  @property
  def specs(self) -> Any:
    """PartitionSpecs of the sharded layout over the batch axes (the
    ``shard_map`` view)."""
    return self._map(lambda lp: lp.spec)

  @property
  def shardings(self) -> Any:
    """NamedShardings of the sharded layout (``data`` and ``model``)."""
    mesh = layout_mesh(self.mesh)
    return self._map(lambda lp: NamedSharding(mesh, lp.global_spec))

  @property
  def replicated_specs(self) -> Any:
    """PartitionSpecs of the replicated layout over the batch axes
    (``P()`` everywhere)."""
    return self._map(lambda lp: P())

  @property
  def replicated_shardings(self) -> Any:
    """NamedShardings of the layout replicated over ``data`` (still split
    over ``model`` as the model says)."""
    mesh = layout_mesh(self.mesh)
    return self._map(lambda lp: NamedSharding(mesh, lp.model_spec))

  @property
  def model_split(self) -> bool:
    """Whether any leaf is split over ``model``."""
    return any(lp.model_split for lp in flat(self.leaves))

  @property
  def replicated_elements(self) -> int:
    """Elements of the leaves kept replicated (small or indivisible)."""
    return sum(math.prod(lp.shape) for _, lp in self.rows() if not lp.sharded)

  def rows(self) -> list[tuple[str, LeafPlan]]:
    """(path, plan) for every leaf, in tree order."""
    flat_, _ = jax.tree_util.tree_flatten_with_path(self.leaves,
                                                    is_leaf=is_plan)
    return [(path_str(p), lp) for p, lp in flat_]
