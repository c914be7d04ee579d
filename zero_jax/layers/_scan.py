"""Per-layer ZeRO inside a scan over stacked layer parameters.

``scan_layers`` is ``jax.lax.scan`` for a stack of layers. Under an
``Engine`` at stage 3 it all-gathers each layer's parameters just before the
layer runs (and, under remat, again in backward, whose transpose
reduce-scatters that layer's gradients right there); at stage 2 it
reduce-scatters each layer's gradients as backward produces them. So one
layer's full parameters and gradients are live at a time, not the whole
model's. Outside an engine, or at stages 0-1, it is a plain (remat'd) scan.

How it finds the parameters: while tracing ``loss_fn``, the engine hands
over a ``zero_jax.materialize.LossContext`` listing every full parameter
array it made, with its shard, layout and ``Materializer``. When such an
array is among the scanned inputs, the scan runs over the shard instead and
materializes one layer slice per iteration with the same ``Materializer``;
the whole-model materialization the engine prepared is then unused and XLA
drops it.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from zero_jax import materialize
from zero_jax.layers._prefetch import (grad_dtype, prefetched_scan,
                                      round_grad)
from zero_jax.layers._remat import kept_names, remat_policy
from zero_jax.layout import MODEL, LeafPlan, Materialize, Prefetch
from zero_jax.layout._mesh import auto_model_size
from zero_jax.materialize._context import current

# The ``checkpoint_name`` of each layer's input (the scan's carry): what
# ``remat="full"`` saves for backward. ``remat="offload_to_host"`` with this
# name keeps it in host memory (DeepSpeed's ``cpu_checkpointing``).
LAYER_INPUT = "layer_input"


def _slice_plan(lp: LeafPlan) -> LeafPlan:
  """The plan of one layer slice of a stacked leaf (layer axis removed)."""
  return lp.sliced()


def partition_activations(carry: Any, batch_sharding: Any = None) -> Any:
  """ZeRO-R's Pa: each ``(batch, sequence, ...)`` leaf of ``carry`` split
  over the ``model`` axis along the sequence (dimension 1), so the copy a
  layer saves for backward takes 1/M of the bytes on each device; the
  layer's first use gathers it back.

  Args:
    carry: the layer input.
    batch_sharding: with a loss of global meaning, the batch's sharding:
      the carry is a global array, its batch dimension kept split as the
      batch is (inside the per-device step's ``shard_map`` it is each
      device's slice, and dimension 0 stays whole).

  Raises:
    ValueError: a leaf's sequence length does not divide by the axis.
  """
  m = model_size(batch_sharding)
  if m == 1:
    return carry
  lead, mesh, n = None, None, 1
  if batch_sharding is not None:
    lead, mesh = _batch_entry(batch_sharding), batch_sharding.mesh
    n = _batch_devices(batch_sharding)

  def split(x):
    if x.ndim < 2:
      return x
    if x.shape[1] % m:
      raise ValueError(
          f"ZeroConfig.partition_activations splits each layer input "
          f"{x.shape} over the {m} devices of '{MODEL}' along dimension 1 "
          f"(the sequence), which {x.shape[1]} does not divide: use a "
          f"sequence length divisible by {m}, or "
          "partition_activations=False.")
    # (A leading dimension the batch's devices do not divide is not the
    # batch: left whole, as _split_over_batch leaves it.)
    spec = P(None if x.shape[0] % n else lead, MODEL,
             *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(
        x, spec if mesh is None else NamedSharding(mesh, spec))

  return jax.tree.map(split, carry)


def model_size(batch_sharding: Any = None) -> int:
  """The tensor-parallel degree the compiler partitions the model by: the
  automatic ``model`` axis of the mesh traced under (the per-device step's
  ``shard_map``), or with a loss of global meaning (no ``shard_map``) the
  ``model`` axis of its batch's mesh."""
  if batch_sharding is None:
    return auto_model_size()
  return dict(batch_sharding.mesh.shape).get(MODEL, 1)


def _batch_entry(sharding: Any) -> Any:
  """The batch sharding's entry for the leading dimension (its axes)."""
  return sharding.spec[0] if len(sharding.spec) else None


def _batch_devices(sharding: Any) -> int:
  """Devices the batch sharding splits the leading dimension over."""
  lead = _batch_entry(sharding)
  axes = (lead,) if isinstance(lead, str) else tuple(lead or ())
  return math.prod(dict(sharding.mesh.shape)[a] for a in axes)


def _prefetches(prefetch: Prefetch, policy: Any, makers: list[Any]) -> bool:
  """Whether this scan gathers one layer ahead. ``ZeroConfig.prefetch``
  asked for (``ON``) is honoured or refused, never dropped; decided by
  the layout (``AUTO``), it applies where this scan allows it."""
  if prefetch is Prefetch.OFF or all(how is None for how in makers):
    return False
  if prefetch is Prefetch.AUTO:
    # (The layout decided it for parameters gathered from their shards.)
    return policy is jax.checkpoint_policies.nothing_saveable
  if policy is not jax.checkpoint_policies.nothing_saveable:
    raise ValueError(
        "ZeroConfig.prefetch recomputes each layer from its input "
        "(remat='full'), but this scan_layers call asks for another remat "
        "policy: drop its remat argument, or use prefetch=False.")
  for how in makers:
    if how is not None and not (
        how[0].kind is Materialize.GATHER or
        (how[0].kind is Materialize.CONSTRAIN and not how[0].to_device)):
      raise ValueError(
          "ZeroConfig.prefetch gathers layers from their float32 shards "
          f"(stage 3), but this engine's layers come {how[0].kind.value!r} "
          "(a compute copy or host memory): use prefetch=False with that "
          "placement.")
  return True


def _split_over_batch(carry: Any, sharding: Any) -> Any:
  """Each leaf of ``carry`` whose leading dimension divides over the batch
  axes, constrained to ``sharding`` there (the compiler would otherwise be
  free to gather activations rather than parameters)."""
  n = _batch_devices(sharding)

  def split(x):
    if not getattr(x, "ndim", 0) or x.shape[0] % n:
      return x
    return jax.lax.with_sharding_constraint(x, sharding)

  return jax.tree.map(split, carry)


def scan_layers(f: Callable[[Any, Any], tuple[Any, Any]], init: Any, xs: Any,
                *, remat: str | None = None,
                remat_names: tuple[str, ...] | None = None
                ) -> tuple[Any, Any]:
  """``jax.lax.scan(f, init, xs)`` over stacked layers, ZeRO-aware.

  Args:
    f: the layer, ``f(carry, x) -> (carry, y)``; ``x`` holds one layer's
      slice of every leaf of ``xs`` (e.g. ``{"w": (d, d), ...}`` for stacked
      ``{"w": (L, d, d)}``).
    init: initial carry (the hidden state).
    xs: pytree whose leaves all have the layer count as leading dimension:
      the stacked parameters, plus anything else to scan over.
    remat: a ``zero_jax.REMAT_POLICIES`` name; default: the engine's
      ``ZeroConfig.remat`` (``"full"`` outside an engine).
    remat_names: ``checkpoint_name`` tags for the named policies; default:
      the engine's ``ZeroConfig.remat_names``.

  Returns:
    ``(carry, ys)`` as from ``jax.lax.scan``.
  """
  context = current() or materialize.LossContext({})
  policy_name = context.remat if remat is None else remat
  names = context.remat_names if remat_names is None else tuple(remat_names)
  leaves, treedef = jax.tree.flatten(xs)
  # Per leaf: what the scan iterates over, and how to turn one slice of it
  # back into the layer's full parameter.
  scanned, makers = [], []
  for x in leaves:
    handed = context.lookup(x)
    if handed is None or handed.plan.dim in (None, 0):
      # Not a ZeRO parameter, or split along the layer axis itself (then a
      # layer lives on one device): scan the full array as given.
      scanned.append(x)
      makers.append(None)
    else:
      # (source is None when gathering from the shard itself.)
      scanned.append((handed.shard, handed.source))
      makers.append((handed.materializer, _slice_plan(handed.plan)))

  if context.params and all(how is None for how in makers):
    # Under an engine at stage 2-3 but none of the scanned arrays is a
    # parameter the engine handed over: the layers fall back to whole-model
    # gathering, which trains exactly but costs the memory ZeRO should save.
    warnings.warn(
        "zero_jax.scan_layers: none of xs is a parameter array the engine "
        "passed to loss_fn, so layers are not gathered/reduced one at a "
        "time. Pass the parameters to the scan unchanged (no astype, "
        "jnp.stack or jax.checkpoint around the model in loss_fn; use "
        "ZeroConfig.compute_dtype for low-precision compute).",
        stacklevel=2)

  policy = remat_policy(policy_name, names, keep=kept_names(
      how for how in makers if how is not None))
  partitioned = (context.partition_activations and
                 model_size(context.batch_sharding) > 1)

  def body(carry, sliced):
    # The layer input: saved for backward (remat "full"), or moved to host
    # under this name; split over ``model`` first with Pa.
    carry = jax.tree.map(lambda x: checkpoint_name(x, LAYER_INPUT), carry)
    if context.batch_sharding is not None:
      # (A global loss: pinned as it came, split over the batch and, with
      # Pa, over 'model'; one pin in and another out would leave the
      # compiler to pick either for the loop's carry.)
      carry = (partition_activations(carry, context.batch_sharding)
               if partitioned else
               _split_over_batch(carry, context.batch_sharding))
    layer = []
    for how, s in zip(makers, sliced):
      if how is None:
        layer.append(s)
      else:
        materializer, lp = how
        shard, source = s
        stored = grad_dtype(materializer, shard.dtype)
        if stored != shard.dtype:
          # The float32 gradient shards are rounded as prefetched_scan
          # stores them, prefetching or not.
          shard = round_grad(shard, stored)
        layer.append(materializer(lp, shard, source))
    carry, y = f(carry, treedef.unflatten(layer))
    # (Split where the carry is made, so the loop carries it split and
    # the copy saved for backward is the split one.)
    return (partition_activations(carry, context.batch_sharding)
            if partitioned else carry), y

  # (Whether to prefetch reads the policy asked for, before ``keep``
  # wraps it.)
  if _prefetches(context.prefetch, remat_policy(policy_name, names), makers):
    if context.batch_sharding is not None:
      # (The layer's input pinned as in ``body``.)
      return prefetched_scan(
          lambda h, x: f(_split_over_batch(h, context.batch_sharding), x),
          init, scanned, makers, treedef)
    return prefetched_scan(f, init, scanned, makers, treedef)
  if policy is not None:
    body = jax.checkpoint(body, policy=policy)
  if partitioned:
    init = partition_activations(init, context.batch_sharding)
  return jax.lax.scan(body, init, scanned)
