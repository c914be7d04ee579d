"""How the engine makes each sharded parameter whole for ``loss_fn``.

The engine traces ``loss_fn`` on full parameter arrays, made from each
device's shard in one of three ways (``Placement.materialize``): all-gathered
from the fp32 shard (``Materialize.GATHER``), all-gathered from another
sharded copy while the gradient goes to a stand-in of the shard
(``GATHER_FROM``), or the replicated copy used as is while its gradient is
reduce-scattered as backward makes it (``SCATTER``). ``Materializer`` is
that choice, the one place that makes it: the engine applies it to whole
leaves, and ``zero_jax.layers`` (a scan over layers, a block run as a unit)
to one layer's slice of them. ``HandedParam`` records how each array handed
over was made, for the ``LossContext`` (``_context.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
from jax.ad_checkpoint import checkpoint_name

from zero_jax.layout import LeafPlan, Materialize
from zero_jax.layout._placement import Quantize
from zero_jax.materialize import _collectives as collectives
from zero_jax.materialize._constrained import (gather_constrained,
                                              use_constrained)
from zero_jax.materialize._hierarchical import gather_hierarchical


# The ``checkpoint_name`` of a parameter gathered to be kept for backward
# (``Materializer.keep``): remat policies save it, so backward reads it
# rather than gathering again.
KEPT = "zero_kept_gathered"


@dataclasses.dataclass(frozen=True)
class Materializer:
  """How one sharded parameter becomes whole, and its gradient a shard.

  Attributes:
    kind: ``GATHER``: full = all_gather(shard) in ``compute_dtype``, the
      gather's transpose reduce-scatters the gradient. ``GATHER_FROM``:
      full = all_gather(source) (copied to the device first if
      ``to_device``), whose gradient goes to ``shard``, a stand-in (in
      host memory if ``grad_to_host``). ``SCATTER``: full is the
      replicated copy ``source``, whose gradient goes to ``shard`` via a
      reduce-scatter. ``CONSTRAIN`` and ``CONSTRAIN_SCATTER``: the same,
      with a loss of global meaning, by sharding constraints
      (``gather_constrained``, ``use_constrained``).
    compute_dtype: dtype of the full parameter (None: as stored).
    reduce_dtype: dtype gradients are summed in (None: as computed).
    to_device: ``GATHER_FROM``: the source is in host memory.
    grad_to_host: ``GATHER_FROM``: the gradient shard goes to host memory.
    quantize: ZeRO++'s quantized gathers (``GATHER``, ``GATHER_FROM``) and
      gradient reductions (all three).
    keep: the full value is kept for backward (stage 2,
      ``Placement.keeps_gathered``): named ``KEPT``, which remat policies
      save.
    mesh: ``CONSTRAIN*``: the mesh the global arrays are laid out on.
  """

  kind: Materialize
  compute_dtype: Any = None
  reduce_dtype: Any = None
  to_device: bool = False
  grad_to_host: bool = False
  quantize: Quantize = Quantize()
  keep: bool = False
  mesh: Any = None

  def __call__(self, plan: LeafPlan, shard: jax.Array,
               source: jax.Array | None) -> jax.Array:
    """The full value of a sharded leaf (or of one layer slice of it, with
    that slice's plan), for use inside ``shard_map``."""
    full = self._make(plan, shard, source)
    return checkpoint_name(full, KEPT) if self.keep else full

  def _make(self, plan: LeafPlan, shard: jax.Array,
            source: jax.Array | None) -> jax.Array:
    if self.kind is Materialize.CONSTRAIN_SCATTER:
      return use_constrained(plan, self.mesh, shard, source,
                             self.compute_dtype, self.reduce_dtype)
    if self.kind is Materialize.CONSTRAIN:
      return gather_constrained(plan, self.mesh, shard, source,
                                self.compute_dtype, self.reduce_dtype,
                                to_host=self.grad_to_host,
                                quantize=self.quantize)
    if plan.hierarchical:
      if self.kind is not Materialize.GATHER:
        raise ValueError(
            f"hpZ gathers from the fp32 master shards (Materialize.GATHER),"
            f" not {self.kind}: keep the master on the device, or "
            "hpz_partition_size=1.")
      return gather_hierarchical(plan, shard, self.compute_dtype,
                                 self.reduce_dtype, self.quantize)
    if self.kind is Materialize.GATHER:
      return collectives.gather_leaf(plan, shard, self.compute_dtype,
                                     self.reduce_dtype, self.quantize)
    if self.kind is Materialize.GATHER_FROM:
      return collectives.gather_from(plan, shard, source, self.compute_dtype,
                                     self.reduce_dtype, self.to_device,
                                     self.grad_to_host, self.quantize)
    return collectives.use_with_scattered_grad(plan, shard, source,
                                               self.reduce_dtype,
                                               self.quantize)


def materialize_together(
    hows: Sequence[tuple[Materializer, LeafPlan]],
    args: Sequence[tuple[jax.Array, jax.Array | None]]) -> list[jax.Array]:
  """``materializer(plan, shard, source)`` of each item, the leaves that a
  materializer gathers from their own shards (``GATHER``, unquantized,
  split over ``data`` alone) in one collective per materializer
  (``gather_leaves``): one layer's parameters as one all-gather, and their
  gradients as one reduction.

  Args:
    hows: per leaf, its ``Materializer`` and (slice) plan.
    args: per leaf, ``(shard, source)``.

  Returns:
    Each leaf's full value, in the order given.
  """
  out: list[jax.Array | None] = [None] * len(hows)
  groups: dict[Materializer, list[int]] = {}
  for i, ((mat, lp), (shard, source)) in enumerate(zip(hows, args)):
    if (mat.kind is Materialize.GATHER and mat.quantize == Quantize() and
        lp.sharded and not lp.model_split and not lp.hierarchical):
      groups.setdefault(mat, []).append(i)
    else:
      out[i] = mat(lp, shard, source)
  for mat, idx in groups.items():
    full = collectives.gather_leaves(
        [hows[i][1] for i in idx], [args[i][0] for i in idx],
        mat.compute_dtype, mat.reduce_dtype)
    for i, x in zip(idx, full):
      out[i] = checkpoint_name(x, KEPT) if mat.keep else x
  return out


# (eq=False: the fields hold traced arrays, which must never be compared.)
@dataclasses.dataclass(frozen=True, eq=False)
class HandedParam:
  """One full parameter array the engine handed to ``loss_fn``.

  Attributes:
    array: the full array itself.
    plan: the leaf's layout.
    shard: what is differentiated: the fp32 shard (``GATHER``) or a
      stand-in of its shape (``GATHER_FROM``, ``SCATTER``).
    source: what is read: None (``GATHER``), the shard gathered from
      (``GATHER_FROM``) or the replicated copy (``SCATTER``).
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
