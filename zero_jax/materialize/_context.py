"""What the engine tells the code that runs inside ``loss_fn``.

While it traces ``loss_fn``, the engine enters ``handing_over(context)``:
the ``LossContext`` lists every full array it handed over (looked up by
identity, since the model receives the very arrays) with its shard, its
``LeafPlan`` and its ``Materializer``, plus the config's remat policy and
the repeated blocks of the parameter tree. A scan over layers that finds
such an array among its inputs scans the shard instead and materializes one
layer at a time; the whole-leaf materialization is then unused and XLA
drops it. The context is a ``contextvars.ContextVar``: each thread (and
each trace) sees only its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator, Mapping

import jax

from zero_jax.layout import Prefetch
from zero_jax.materialize._materializer import HandedParam


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
      or not), for finding the blocks (``zero_jax.layers``).
    units: the repeated blocks of the parameter tree
      (``zero_jax.layers.find_units``).
    layer_classes: ``ZeroConfig.layer_classes``.
    partition_activations: ``ZeroConfig.partition_activations``.
    prefetch: whether scanned layers are gathered one layer ahead
      (``ZeroConfig.prefetch`` as the layout decided it).
    batch_sharding: with a loss of global meaning, the batch's sharding:
      ``zero_jax.scan_layers`` keeps each layer's input split so along its
      leading (batch) dimension, where the compiler places every
      collective (None: inside the per-device step).
    seen: filled while tracing: the units run, ``{name: calls}``.
  """

  params: Mapping[int, HandedParam]
  remat: str = "full"
  remat_names: tuple[str, ...] = ()
  full: tuple[Any, ...] = ()
  units: tuple[Any, ...] = ()
  layer_classes: tuple[str, ...] | None = None
  partition_activations: bool = False
  prefetch: Prefetch = Prefetch.OFF
  batch_sharding: Any = None
  seen: dict[str, int] = dataclasses.field(default_factory=dict)

  @classmethod
  def of(cls, params: list[HandedParam], remat: str = "full",
         remat_names: tuple[str, ...] = (), *, full: Any = (),
         units: tuple[Any, ...] = (),
         layer_classes: tuple[str, ...] | None = None,
         partition_activations: bool = False,
         prefetch: Prefetch = Prefetch.OFF,
         batch_sharding: Any = None) -> "LossContext":
    """The context for these handed-over parameters."""
    return cls({id(p.array): p for p in params}, remat, tuple(remat_names),
               tuple(jax.tree.leaves(full)), tuple(units), layer_classes,
               partition_activations, prefetch, batch_sharding)

  @property
  def runs_units(self) -> bool:
    """Whether blocks called as units (``zero_jax.layer``, Flax modules of
    ``layer_classes``) gather their own parameters: wherever parameters
    were handed over (with a loss of global meaning, where the engine
    gathers them itself: ``zero_jax.train``'s ``hands_over``)."""
    return bool(self.params)

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
