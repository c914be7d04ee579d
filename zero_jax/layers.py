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
from typing import Any, Callable

import jax

from zero_jax import collectives
from zero_jax.plan import LeafPlan

# Remat policies by name. None of them saves gathered parameters: saving them
# would keep every layer's full parameters alive until backward (stage 2
# memory at stage 3).
REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class _Recorded:
  """How one full parameter handed to ``loss_fn`` was made.

  kind "gather": full = all_gather(shard). kind "scatter": full is the
  replicated copy ``source``, whose gradient goes to ``shard`` via a
  reduce-scatter.
  """

  kind: str
  plan: LeafPlan
  shard: jax.Array
  source: jax.Array | None = None


class _Context(threading.local):

  def __init__(self):
    self.recorded: dict[int, _Recorded] | None = None
    self.remat: str = "full"


_CTX = _Context()


@contextlib.contextmanager
def _recording(recorded: dict[int, _Recorded], remat: str):
  """Used by the engine around its call of ``loss_fn``."""
  prev = (_CTX.recorded, _CTX.remat)
  _CTX.recorded, _CTX.remat = recorded, remat
  try:
    yield
  finally:
    _CTX.recorded, _CTX.remat = prev


def _slice_plan(lp: LeafPlan) -> LeafPlan:
  """The plan of one layer slice of a stacked leaf (layer axis removed)."""
  return LeafPlan(lp.shape[1:], lp.dim - 1)


def scan_layers(f: Callable[[Any, Any], tuple[Any, Any]], init: Any, xs: Any,
                *, remat: str | None = None) -> tuple[Any, Any]:
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

  Returns:
    ``(carry, ys)`` as from ``jax.lax.scan``.
  """
  recorded = _CTX.recorded or {}
  policy_name = _CTX.remat if remat is None else remat
  if policy_name not in REMAT_POLICIES:
    raise ValueError(f"unknown remat policy {policy_name!r}; choose one of "
                     f"{sorted(REMAT_POLICIES)}")
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
      materialize.append(("gather", _slice_plan(rec.plan)))
    else:
      scanned.append((rec.shard, rec.source))
      materialize.append(("scatter", _slice_plan(rec.plan)))

  def body(carry, sliced):
    layer = []
    for how, s in zip(materialize, sliced):
      if how is None:
        layer.append(s)
      elif how[0] == "gather":
        layer.append(collectives.gather_leaf(how[1], s))
      else:
        shard, source = s
        layer.append(collectives.use_with_scattered_grad(how[1], shard,
                                                         source))
    return f(carry, treedef.unflatten(layer))

  policy = REMAT_POLICIES[policy_name]
  if policy_name != "none":
    body = jax.checkpoint(body, policy=policy)
  return jax.lax.scan(body, init, scanned)
