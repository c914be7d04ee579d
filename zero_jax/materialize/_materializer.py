"""How the engine hands full parameters to ``loss_fn``, and what it tells
the layer scan about them.

The engine traces ``loss_fn`` on full parameter arrays, made from each
device's shard in one of three ways (``Placement.materialize``): all-gathered
from the fp32 shard (``"gather"``), all-gathered from another sharded copy
while the gradient goes to a stand-in of the shard (``"gather_from"``), or
the replicated copy used as is while its gradient is reduce-scattered as
backward makes it (``"scatter"``). ``Materializer`` is that choice, the one
place that makes it: the engine applies it to whole leaves, and
``zero_jax.scan_layers`` to one layer's slice of them.

While it traces ``loss_fn``, the engine enters ``handing_over(context)``:
the ``LossContext`` lists every full array it handed over (looked up by
identity, since the model receives the very arrays) with its shard, its
``LeafPlan`` and its ``Materializer``, plus the config's remat policy. A
scan over layers that finds such an array among its inputs scans the shard
instead and materializes one layer at a time; the whole-leaf
materialization is then unused and XLA drops it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator, Mapping

import jax

from zero_jax.layout import LeafPlan, Materialize
from zero_jax.materialize import _collectives as collectives


@dataclasses.dataclass(frozen=True)
class Materializer:
  """How one sharded parameter becomes whole, and its gradient a shard.

  Attributes:
    kind: ``"gather"``: full = all_gather(shard) in ``compute_dtype``, the
      gather's transpose reduce-scatters the gradient. ``"gather_from"``:
      full = all_gather(source) (copied to the device first if
      ``to_device``), whose gradient goes to ``shard``, a stand-in (in
      host memory if ``grad_to_host``). ``"scatter"``: full is the
      replicated copy ``source``, whose gradient goes to ``shard`` via a
      reduce-scatter.
    compute_dtype: dtype of the full parameter (None: as stored).
    reduce_dtype: dtype gradients are summed in (None: as computed).
    to_device: ``"gather_from"``: the source is in host memory.
    grad_to_host: ``"gather_from"``: the gradient shard goes to host memory.
  """

  kind: Materialize
  compute_dtype: Any = None
  reduce_dtype: Any = None
  to_device: bool = False
  grad_to_host: bool = False

  def __call__(self, plan: LeafPlan, shard: jax.Array,
               source: jax.Array | None) -> jax.Array:
    """The full value of a sharded leaf (or of one layer slice of it, with
    that slice's plan), for use inside ``shard_map``."""
    if self.kind is Materialize.GATHER:
      return collectives.gather_leaf(plan, shard, self.compute_dtype,
                                     self.reduce_dtype)
    if self.kind is Materialize.GATHER_FROM:
      return collectives.gather_from(plan, shard, source, self.compute_dtype,
                                     self.reduce_dtype, self.to_device,
                                     self.grad_to_host)
    return collectives.use_with_scattered_grad(plan, shard, source,
                                               self.reduce_dtype)


# (eq=False: the fields hold traced arrays, which must never be compared.)
@dataclasses.dataclass(frozen=True, eq=False)
class HandedParam:
  """One full parameter array the engine handed to ``loss_fn``.

  Attributes:
    array: the full array itself.
    plan: the leaf's layout.
    shard: what is differentiated: the fp32 shard (``"gather"``) or a
      stand-in of its shape (``"gather_from"``, ``"scatter"``).
    source: what is read: None (``"gather"``), the shard gathered from
      (``"gather_from"``) or the replicated copy (``"scatter"``).
    materializer: how ``array`` was made from them.
  """

  array: jax.Array
  plan: LeafPlan
  shard: jax.Array
  source: jax.Array | None
  materializer: Materializer

  @classmethod
  def make(cls, plan: LeafPlan, shard: jax.Array, source: jax.Array | None,
           materializer: Materializer) -> "HandedParam":
    """Materializes the full array and records how."""
    return cls(materializer(plan, shard, source), plan, shard, source,
               materializer)


@dataclasses.dataclass(frozen=True, eq=False)
class LossContext:
  """What the engine tells the code that runs inside ``loss_fn``.

  Attributes:
    params: every sharded parameter made whole for ``loss_fn``, keyed by
      ``id`` of its full array (empty at stages 0-1, which hand over whole
      parameters); see ``LossContext.of``.
    remat: the ``ZeroConfig.remat`` policy name.
    remat_names: the ``ZeroConfig.remat_names`` tags.
    full: every parameter array handed to ``loss_fn``, flattened (sharded
      or not), for finding the blocks (``zero_jax.blocks``).
    units: the repeated blocks of the parameter tree
      (``zero_jax.blocks.find_units``).
    layer_classes: ``ZeroConfig.layer_classes``.
    seen: filled while tracing: the units run, ``{name: calls}``.
  """

  params: Mapping[int, HandedParam]
  remat: str = "full"
  remat_names: tuple[str, ...] = ()
  full: tuple[Any, ...] = ()
  units: tuple[Any, ...] = ()
  layer_classes: tuple[str, ...] | None = None
  seen: dict[str, int] = dataclasses.field(default_factory=dict)

  @classmethod
  def of(cls, params: list[HandedParam], remat: str = "full",
         remat_names: tuple[str, ...] = (), *, full: Any = (),
         units: tuple[Any, ...] = (),
         layer_classes: tuple[str, ...] | None = None) -> "LossContext":
    """The context for these handed-over parameters."""
    return cls({id(p.array): p for p in params}, remat, tuple(remat_names),
               tuple(jax.tree.leaves(full)), tuple(units), layer_classes)

  def unit_of(self, leaves: list[Any]) -> Any:
    """The unit whose parameters are exactly ``leaves`` (the arrays handed
    over, by identity), or None."""
    index = {id(x): i for i, x in enumerate(self.full)}
    found = set()
    for x in leaves:
      i = index.get(id(x))
      if i is None or self.full[i] is not x:
        return None
      found.add(i)
    return next((u for u in self.units if u.leaves == found), None)

  def lookup(self, x: Any) -> HandedParam | None:
    """The ``HandedParam`` of ``x`` if it is one of the arrays handed over
    (the same object, not an equal one)."""
    found = self.params.get(id(x))
    return found if found is not None and found.array is x else None


_CURRENT: contextvars.ContextVar[LossContext | None] = contextvars.ContextVar(
    "zero_jax_loss_context", default=None)


@contextlib.contextmanager
def handing_over(context: LossContext) -> Iterator[LossContext]:
  """Makes ``context`` the current one while the engine traces
  ``loss_fn``."""
  token = _CURRENT.set(context)
  try:
    yield context
  finally:
    _CURRENT.reset(token)


def current() -> LossContext | None:
  """The ``LossContext`` of the ``loss_fn`` being traced, or None outside
  an engine."""
  return _CURRENT.get()
