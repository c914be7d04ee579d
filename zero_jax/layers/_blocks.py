"""Per-block ZeRO for blocks called one after another, as most models are
written: ``for block in self.blocks: x = block(x)``.

A scan (``zero_jax.scan_layers``) keeps one layer's full parameters live at a
time by construction. An unrolled loop does not: XLA hoists every block's
all-gather to the start of the step (on an H100-compiled 16-layer stack, temp
1.06x all the bf16 parameters against 0.21x scanned). ``layer(f)`` runs one
block as a *unit* instead: a ``custom_vjp`` whose forward ties the block's
parameter shards to its incoming activation with
``jax.lax.optimization_barrier`` before gathering them, and whose backward
ties them to the incoming cotangent before re-gathering (the block is
remat'd with ``ZeroConfig.remat``) and its gradients' reduce-scatter to the
outgoing cotangent. So a block's parameters are gathered as it runs, twice
per step, and its gradients are reduce-scattered as backward leaves it. The
CPU scheduler ignores the barriers; memory claims are made on GPU-compiled
programs.

The engine finds the units by itself (``ZeroConfig.layer_classes=None``):

* from the parameter tree, once: sibling subtrees with identical structure
  and shapes (``blocks/0``, ``blocks/1``, ... of an NNX list; ``Block_0``,
  ``Block_1``, ... of Linen; ``layers/3`` of a plain dict), outermost first;
* while tracing ``loss_fn``, every Flax module call (Linen through
  ``nn.intercept_methods``; NNX by wrapping the ``__call__`` of Module
  classes, for the trace only) whose parameters are exactly one such
  subtree runs as a unit. ``layer_classes=("Block",)`` names the classes
  instead (any parameters), ``()`` turns it off. Plain JAX code wraps the
  block function itself: ``x = zj.layer(block_fn)(params_i, x)``.

A block with state besides its parameters (an NNX ``BatchStat`` or ``Rngs``,
a Linen collection other than ``params``) runs as written.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable, Iterator

import jax
import numpy as np

from zero_jax import materialize
from zero_jax._compat import varying_axes
from zero_jax._paths import key_name
from zero_jax.layers._remat import remat_policy

# Set while a unit runs its block: the block's own module calls (and the
# unit's pure re-application of the module) are not units again.
_INSIDE = contextvars.ContextVar("zero_jax_inside_unit", default=False)


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
  """The repeated blocks of a parameter tree: under one parent, two or more
  children whose subtrees have the same structure, shapes and dtypes. The
  outermost such children win (a block's own repeated parts stay inside
  it)."""
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
  """``Engine.describe()``'s lines on the blocks."""
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


# ------------------------------------------------------------------ layer


def layer(f: Callable[..., Any], *, remat: str | None = None,
          remat_names: tuple[str, ...] | None = None,
          _counted: bool = False) -> Callable[..., Any]:
  """``f(params, *args, **kwargs)`` run as one ZeRO unit.

  Under an ``Engine`` at stages 2-3, the sharded leaves of ``params`` (the
  arrays the engine handed to ``loss_fn``, unchanged) are gathered inside
  the unit, tied to its input, re-gathered in its backward and their
  gradients reduce-scattered there. Elsewhere ``f`` runs as written (under
  ``jax.checkpoint`` with the policy, as in a scan).

  Args:
    f: the block, e.g. ``lambda p, x: x + mlp(p, x)``.
    remat: a ``REMAT_POLICIES`` name; default: ``ZeroConfig.remat``.
    remat_names: tags for the named policies; default: the config's.

  Returns:
    A function with ``f``'s signature.
  """

  @functools.wraps(f)
  def unit(params: Any, *args: Any, **kwargs: Any) -> Any:
    context = materialize.current()
    if _INSIDE.get() or context is None or not context.params:
      return f(params, *args, **kwargs)
    policy = remat_policy(
        context.remat if remat is None else remat,
        context.remat_names if remat_names is None else tuple(remat_names))
    leaves, treedef = jax.tree.flatten(params)
    handed = [context.lookup(x) for x in leaves]
    if not any(handed):
      return f(params, *args, **kwargs)
    if not _counted:  # (module calls are counted by class where found)
      name = getattr(f, "__name__", "layer")
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

  return unit


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


# ------------------------------------------------------------ interception


@contextlib.contextmanager
def intercepting(context: materialize.LossContext) -> Iterator[None]:
  """Runs matching Flax module calls as units while ``loss_fn`` is traced
  (see the module docstring)."""
  if context.layer_classes == () or not context.params:
    yield
    return
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  with _nnx_calls(context), nn.intercept_methods(
      functools.partial(_linen_call, context)):
    yield


def _matches(context: materialize.LossContext, module: Any,
             leaves: list[Any]) -> bool:
  """Whether a module with these parameter leaves runs as a unit."""
  if not leaves or _INSIDE.get():
    return False
  name = type(module).__name__
  if context.layer_classes is not None:
    found = name in context.layer_classes
  else:
    found = context.unit_of(leaves) is not None
  if found:
    context.seen[name] = context.seen.get(name, 0) + 1
  return found


def _linen_call(context, next_fun, args, kwargs, call):
  module = call.module
  if call.method_name != "__call__":
    return next_fun(*args, **kwargs)
  variables = module.variables if module.scope is not None else {}
  params = variables.get("params", {})
  leaves = jax.tree.leaves(params)
  if set(variables) - {"params"} or not _matches(context, module, leaves):
    return next_fun(*args, **kwargs)
  rngs = {name: module.make_rng(name)
          for name in getattr(module.scope, "rngs", {})}
  detached = module.clone(parent=None)
  apply = lambda p, *a, **kw: detached.apply({"params": p}, *a, rngs=rngs,
                                             **kw)
  return layer(apply, _counted=True)(params, *args, **kwargs)


@contextlib.contextmanager
def _nnx_calls(context) -> Iterator[None]:
  """Wraps the ``__call__`` of every NNX Module class for the block."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  classes, stack = [], [nnx.Module]
  while stack:
    cls = stack.pop()
    stack.extend(cls.__subclasses__())
    if "__call__" in vars(cls) and cls.__module__.split(".")[0] != "flax":
      classes.append(cls)
  originals = {cls: vars(cls)["__call__"] for cls in classes}
  for cls, original in originals.items():
    setattr(cls, "__call__", _nnx_wrapper(context, original))
  try:
    yield
  finally:
    for cls, original in originals.items():
      setattr(cls, "__call__", original)


def _nnx_wrapper(context, original):
  from flax import nnx  # pylint: disable=g-import-not-at-top

  @functools.wraps(original)
  def call(self, *args, **kwargs):
    if _INSIDE.get():
      return original(self, *args, **kwargs)
    graphdef, params, rest = nnx.split(self, nnx.Param, ...)
    leaves = jax.tree.leaves(params)
    if jax.tree.leaves(rest) or not _matches(context, self, leaves):
      return original(self, *args, **kwargs)
    apply = lambda p, *a, **kw: original(nnx.merge(graphdef, p), *a, **kw)
    return layer(apply, _counted=True)(params, *args, **kwargs)

  return call
