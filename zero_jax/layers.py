"""Per-layer ZeRO inside a scan over stacked layer parameters.

``scan_layers`` is ``jax.lax.scan`` for a stack of layers. Under an
``Engine`` at stage 3 it all-gathers each layer's parameters just before the
layer runs (and, under remat, again in backward, whose transpose
reduce-scatters that layer's gradients right there); at stage 2 it
reduce-scatters each layer's gradients as backward produces them. So one
layer's full parameters and gradients are live at a time, not the whole
model's. Outside an engine, or at stages 0-1, it is a plain (remat'd) scan.

How it finds the parameters: while tracing ``loss_fn``, the engine records
every full parameter array it hands over together with its shard and layout.
When a recorded array is among the scanned inputs, the scan runs over the
shard instead and materializes one layer slice per iteration; the
whole-model materialization the engine prepared is then unused and XLA drops
it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from typing import Any, Callable

import jax
from jax.ad_checkpoint import checkpoint_name

from zero_jax import collectives
from zero_jax.plan import LeafPlan
from zero_jax.remat import NAMED_POLICIES, REMAT_POLICIES, remat_policy

# ``checkpoint_name(x, name)`` tags an activation for the named policies; it
# is ``jax.ad_checkpoint.checkpoint_name``, re-exported for convenience.
__all__ = ["NAMED_POLICIES", "REMAT_POLICIES", "checkpoint_name",
           "remat_policy", "scan_layers"]


@dataclasses.dataclass(frozen=True)
class _Recorded:
  """How one full parameter handed to ``loss_fn`` was made.

  kind "gather": full = all_gather(shard) in ``compute_dtype``. kind
  "scatter": full is the replicated copy ``source``, whose gradient goes to
  ``shard`` via a reduce-scatter. kind "gather_from": full =
  all_gather(source) (copied to the device first if ``to_device``), whose
  gradient goes to ``shard`` (in host memory if ``grad_to_host``).
  Gradients are summed in ``reduce_dtype``.
  """

  kind: str
  plan: LeafPlan
  shard: jax.Array
  source: jax.Array | None = None
  compute_dtype: Any = None
  reduce_dtype: Any = None
  to_device: bool = False
  grad_to_host: bool = False


class _Context(threading.local):

  def __init__(self):
    self.recorded: dict[int, _Recorded] | None = None
    self.remat: str = "full"
    self.remat_names: tuple[str, ...] = ()


_CTX = _Context()


@contextlib.contextmanager
def _recording(recorded: dict[int, _Recorded], remat: str,
               remat_names: tuple[str, ...] = ()):
  """Used by the engine around its call of ``loss_fn``."""
  prev = (_CTX.recorded, _CTX.remat, _CTX.remat_names)
  _CTX.recorded, _CTX.remat, _CTX.remat_names = recorded, remat, remat_names
  try:
    yield
  finally:
    _CTX.recorded, _CTX.remat, _CTX.remat_names = prev


def _slice_plan(lp: LeafPlan) -> LeafPlan:
  """The plan of one layer slice of a stacked leaf (layer axis removed)."""
  return LeafPlan(lp.shape[1:], lp.dim - 1)


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
    remat: a key of ``REMAT_POLICIES``; default: the engine's
      ``ZeroConfig.remat`` (``"full"`` outside an engine).
    remat_names: ``checkpoint_name`` tags for the named policies; default:
      the engine's ``ZeroConfig.remat_names``.

  Returns:
    ``(carry, ys)`` as from ``jax.lax.scan``.
  """
  recorded = _CTX.recorded or {}
  policy_name = _CTX.remat if remat is None else remat
  names = _CTX.remat_names if remat_names is None else tuple(remat_names)
  policy = remat_policy(policy_name, names)
  leaves, treedef = jax.tree.flatten(xs)
  # Per leaf: what the scan iterates over, and how to turn one slice of it
  # back into the layer's full parameter.
  scanned, materialize = [], []
  for x in leaves:
    rec = recorded.get(id(x))
    if rec is None or rec.plan.dim in (None, 0):
      # Not a ZeRO parameter, or split along the layer axis itself (then a
      # layer lives on one device): scan the full array as given.
      scanned.append(x)
      materialize.append(None)
    elif rec.kind == "gather":
      scanned.append(rec.shard)
      materialize.append((rec, _slice_plan(rec.plan)))
    else:
      scanned.append((rec.shard, rec.source))
      materialize.append((rec, _slice_plan(rec.plan)))

  if recorded and all(how is None for how in materialize):
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

  def body(carry, sliced):
    layer = []
    for how, s in zip(materialize, sliced):
      if how is None:
        layer.append(s)
        continue
      rec, lp = how
      if rec.kind == "gather":
        layer.append(collectives.gather_leaf(lp, s, rec.compute_dtype,
                                             rec.reduce_dtype))
      elif rec.kind == "gather_from":
        shard, source = s
        layer.append(collectives.gather_from(lp, shard, source,
                                             rec.compute_dtype,
                                             rec.reduce_dtype, rec.to_device,
                                             rec.grad_to_host))
      else:
        shard, source = s
        layer.append(collectives.use_with_scattered_grad(
            lp, shard, source, rec.reduce_dtype))
    return f(carry, treedef.unflatten(layer))

  if policy is not None:
    body = jax.checkpoint(body, policy=policy)
  return jax.lax.scan(body, init, scanned)
