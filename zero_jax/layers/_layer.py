"""``layer(f)``: one block run as a ZeRO unit.

A scan (``zero_jax.scan_layers``) keeps one layer's full parameters live at
a time by construction. An unrolled loop (``for block in self.blocks: x =
block(x)``) does not: XLA hoists every block's all-gather to the start of
the step (on an H100-compiled 16-layer stack, temp 1.06x all the bf16
parameters against 0.21x scanned). ``layer(f)`` runs one block as a *unit*
instead: a ``custom_vjp`` whose forward ties the block's parameter shards
to its incoming activation with ``jax.lax.optimization_barrier`` before
gathering them, and whose backward ties them to the incoming cotangent
before re-gathering (the block is remat'd with ``ZeroConfig.remat``) and
its gradients' reduce-scatter to the outgoing cotangent. So a block's
parameters are gathered as it runs, twice per step, and its gradients are
reduce-scattered as backward leaves it. The CPU scheduler ignores the
barriers; memory claims are made on GPU-compiled programs.

Plain JAX code wraps the block function itself: ``x =
zj.layer(block_fn)(params_i, x)``. Flax module calls are wrapped by the
engine while it traces ``loss_fn`` (``zero_jax.layers._intercept``),
through ``run_as_unit``.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any, Callable

import jax
import numpy as np

from zero_jax._compat import varying_axes
from zero_jax.layers._remat import kept_names, remat_policy
from zero_jax.materialize._context import current

# Set while a unit runs its block: the block's own module calls (and the
# unit's pure re-application of the module) are not units again.
_INSIDE = contextvars.ContextVar("zero_jax_inside_unit", default=False)


def inside_unit() -> bool:
  """Whether the calling code runs inside a unit's block (where nothing is
  a unit again)."""
  return _INSIDE.get()


def layer(f: Callable[..., Any], *, remat: str | None = None,
          remat_names: tuple[str, ...] | None = None) -> Callable[..., Any]:
  """``f(params, *args, **kwargs)`` run as one ZeRO unit.

  Under an ``Engine`` at stages 2-3, the sharded leaves of ``params`` (the
  arrays the engine handed to ``loss_fn``, unchanged) are gathered inside
  the unit, tied to its input, re-gathered in its backward and their
  gradients reduce-scattered there. Elsewhere ``f`` runs as written (under
  ``jax.checkpoint`` with the policy, as in a scan).

  Args:
    f: the block, e.g. ``lambda p, x: x + mlp(p, x)``.
    remat: a ``zero_jax.REMAT_POLICIES`` name; default:
      ``ZeroConfig.remat``.
    remat_names: tags for the named policies; default: the config's.

  Returns:
    A function with ``f``'s signature. Each call that runs as a unit is
    counted under ``f``'s name in ``Engine.units_seen``.
  """
  name = getattr(f, "__name__", "layer")

  @functools.wraps(f)
  def unit(params: Any, *args: Any, **kwargs: Any) -> Any:
    return run_as_unit(f, params, args, kwargs, name=name, remat=remat,
                       remat_names=remat_names)

  return unit


def run_as_unit(f: Callable[..., Any], params: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any], *, name: str,
                remat: str | None = None,
                remat_names: tuple[str, ...] | None = None) -> Any:
  """``f(params, *args, **kwargs)``, as a unit where the engine handed
  ``params`` over (see ``layer``).

  Args:
    f: the block.
    params: its parameters, as handed to ``loss_fn``.
    args: its other positional arguments.
    kwargs: its keyword arguments.
    name: what the call is counted as in ``LossContext.seen`` when it runs
      as a unit (a function's or a module class's name).
    remat: as for ``layer``.
    remat_names: as for ``layer``.

  Returns:
    What ``f`` returns.
  """
  context = current()
  if _INSIDE.get() or context is None or not context.runs_units:
    return f(params, *args, **kwargs)
  leaves, treedef = jax.tree.flatten(params)
  handed = [context.lookup(x) for x in leaves]
  if not any(handed):
    return f(params, *args, **kwargs)
  policy = remat_policy(
      context.remat if remat is None else remat,
      context.remat_names if remat_names is None else tuple(remat_names),
      keep=kept_names((h.materializer, h.plan) for h in handed
                      if h is not None))
  context.seen[name] = context.seen.get(name, 0) + 1
  # Each sharded leaf enters as (shard, source) and is made whole inside;
  # others enter as they are. Non-array arguments are static.
  inputs = [x if h is None else (h.shard, h.source)
            for h, x in zip(handed, leaves)]
  arg_leaves, arg_tree = jax.tree.flatten((args, kwargs))
  dynamic = [isinstance(a, (jax.Array, np.ndarray)) for a in arg_leaves]

  def body(inputs, dyn):
    full = [x if h is None else h.materializer(h.plan, *x)
            for h, x in zip(handed, inputs)]
    it = iter(dyn)
    a, kw = jax.tree.unflatten(
        arg_tree, [next(it) if d else s for d, s in zip(dynamic,
                                                        arg_leaves)])
    token = _INSIDE.set(True)
    try:
      return f(jax.tree.unflatten(treedef, full), *a, **kw)
    finally:
      _INSIDE.reset(token)

  dyn = [a for a, d in zip(arg_leaves, dynamic) if d]
  return _tied(body, policy)(inputs, dyn)


def _tied(body: Callable[..., Any], policy: Any) -> Callable[..., Any]:
  """``body`` as a custom_vjp whose gathers wait for the activation (in
  forward) and the cotangent (in backward)."""
  fn = body if policy is None else jax.checkpoint(body, policy=policy)
  primal_axes = []  # each primal input's varying mesh axes (set in fwd)

  @jax.custom_vjp
  def run(inputs, dyn):
    return fn(inputs, dyn)

  def fwd(inputs, dyn):
    primal_axes[:] = [varying_axes(x) for x in jax.tree.leaves((inputs,
                                                                dyn))]
    # (The barrier makes its operands vary over the union of their axes.)
    inputs, dyn = jax.lax.optimization_barrier((inputs, dyn))
    out, vjp = jax.vjp(fn, inputs, dyn)
    return out, vjp

  def bwd(vjp, ct):
    # vjp holds what the policy saved (with "full": the shards and inputs
    # alone): tied to the cotangent, the re-gather cannot run early.
    ct, vjp = jax.lax.optimization_barrier((ct, vjp))
    grads = jax.lax.optimization_barrier(vjp(ct))
    leaves, tree = jax.tree.flatten(grads)
    return jax.tree.unflatten(tree, [
        _like(g, axes) for g, axes in zip(leaves, primal_axes)])

  run.defvjp(fwd, bwd)
  return run


def _like(g: jax.Array, axes: frozenset[str]) -> jax.Array:
  """A cotangent typed as its primal varies: summed over the axes the
  barrier added (the transpose of varying over them), marked varying over
  those it lacks."""
  if g.dtype == jax.dtypes.float0:
    return g
  have = varying_axes(g)
  extra, missing = tuple(have - axes), tuple(axes - have)
  if extra:
    g = jax.lax.psum(g, extra)
  return jax.lax.pcast(g, missing, to="varying") if missing else g
