"""Flax module calls run as units while the engine traces ``loss_fn``.

The engine finds the units by itself (``ZeroConfig.layer_classes=None``):
the repeated blocks of the parameter tree (``find_units``), then, while it
traces ``loss_fn``, every Flax module call whose parameters are exactly one
such block runs as a unit (``run_as_unit``). ``layer_classes=("Block",)``
names the classes instead (any parameters), ``()`` turns it off. A block
with state besides its parameters (an NNX ``BatchStat`` or ``Rngs``, a
Linen collection other than ``params``) runs as written.

Linen module calls are intercepted with ``flax.linen.intercept_methods``,
which Flax supports and keeps per thread.

NNX has no such hook: ``block(x)`` looks ``__call__`` up on the class, so
the class's ``__call__`` is what must change. That is done here, and only
here, so that a thread never sees a class behave differently because
another thread is tracing:

* The interception context lives in a ``contextvars.ContextVar``, set by
  ``intercepting`` in the tracing thread only: other threads run in
  contexts of their own, where it is unset.
* While at least one trace needs them, the classes carry a *dispatching*
  wrapper that holds no context: it reads the calling thread's. With none
  (any other thread, or this one outside the trace), or inside a unit's
  block, it calls the original ``__call__`` with the same arguments, so
  other threads get exactly the original behaviour; two engines tracing in
  two threads each see their own context. (What another thread can tell
  is only the object: ``vars(cls)["__call__"]`` is the wrapper for the
  while, with the original's name, docstring and signature.)
* Wrapping is reference-counted per class under a lock: the first trace
  to need a class saves its own ``__call__`` and installs the wrapper, the
  last to leave puts the saved object back. Traces may enter and leave in
  any order, and none leaves a wrapper behind; nothing is wrapped at
  import or between traces.
* Only what a trace can intercept is wrapped: NNX ``Module`` subclasses
  outside Flax that define their own ``__call__``, as they are when the
  trace enters; with ``layer_classes`` named, only the classes those
  names' calls reach (the first class of each named class's MRO that
  defines ``__call__``).

Code run in a copy of the tracing thread's context (``contextvars.
copy_context().run``, or a thread started to inherit it) belongs to that
trace and is intercepted as the trace is.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import threading
from typing import Any, Callable, Iterable, Iterator

import jax

from zero_jax import materialize
from zero_jax.layers._layer import inside_unit, run_as_unit

# The context of the trace that runs in this thread (None: no trace
# intercepts here, whatever the classes carry).
_CONTEXT: contextvars.ContextVar[materialize.LossContext | None] = (
    contextvars.ContextVar("zero_jax_intercepting", default=None))


@dataclasses.dataclass
class _Wrapped:
  """A class's ``__call__`` while traces need it wrapped.

  Attributes:
    original: the class's own ``__call__`` before the first trace wrapped
      it (what the last trace to leave puts back).
    wrapper: the dispatching wrapper installed instead.
    traces: how many traces hold the wrapper now.
  """

  original: Any
  wrapper: Callable[..., Any]
  traces: int = 0


# Guards _WRAPPED and every assignment to a class's __call__.
_LOCK = threading.Lock()
_WRAPPED: dict[type, _Wrapped] = {}


@contextlib.contextmanager
def intercepting(context: materialize.LossContext) -> Iterator[None]:
  """Runs matching Flax module calls as units while ``loss_fn`` is traced
  in this thread (see the module docstring).

  Args:
    context: the context the engine hands over for this trace.

  Yields:
    Nothing; on leaving, the classes this trace wrapped are put back
    unless another trace still holds them.
  """
  if context.layer_classes == () or not context.runs_units:
    yield
    return
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  token = _CONTEXT.set(context)
  try:
    with _holding(_nnx_classes(context.layer_classes)), nn.intercept_methods(
        functools.partial(_linen_call, context)):
      yield
  finally:
    _CONTEXT.reset(token)


def _matches(context: materialize.LossContext, module: Any,
             leaves: list[Any]) -> bool:
  """Whether a module with these parameter leaves runs as a unit."""
  if not leaves or inside_unit():
    return False
  if context.layer_classes is not None:
    return type(module).__name__ in context.layer_classes
  return context.unit_of(leaves) is not None


# ---------------------------------------------------------------- Linen


def _linen_call(context, next_fun, args, kwargs, call):
  module = call.module
  if call.method_name != "__call__":
    return next_fun(*args, **kwargs)
  variables = module.variables if module.scope is not None else {}
  params = variables.get("params", {})
  if set(variables) - {"params"} or not _matches(context, module,
                                                 jax.tree.leaves(params)):
    return next_fun(*args, **kwargs)
  rngs = {name: module.make_rng(name)
          for name in getattr(module.scope, "rngs", {})}
  detached = module.clone(parent=None)
  apply = lambda p, *a, **kw: detached.apply({"params": p}, *a, rngs=rngs,
                                             **kw)
  return run_as_unit(apply, params, args, kwargs, name=type(module).__name__)


# ------------------------------------------------------------------ NNX


def _nnx_classes(layer_classes: tuple[str, ...] | None) -> list[type]:
  """The NNX classes whose ``__call__`` a trace with these
  ``layer_classes`` wraps (see the module docstring)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  found, stack = {nnx.Module: None}, [nnx.Module]
  while stack:
    for sub in type.__subclasses__(stack.pop()):
      if sub not in found:  # (a class with two NNX bases comes twice)
        found[sub] = None
        stack.append(sub)
  if layer_classes is not None:
    found = {_call_owner(c): None for c in found
             if c.__name__ in layer_classes}
  return [c for c in found if c is not None and "__call__" in vars(c)
          and c.__module__.split(".")[0] != "flax"]


def _call_owner(cls: type) -> type | None:
  """The class whose ``__call__`` an instance of ``cls`` runs."""
  return next((c for c in cls.__mro__ if "__call__" in vars(c)), None)


@contextlib.contextmanager
def _holding(classes: Iterable[type]) -> Iterator[None]:
  """Holds the dispatching wrapper on ``classes`` (installing it where no
  other trace holds it) until the trace leaves."""
  held = []
  try:
    with _LOCK:
      for cls in classes:
        wrapped = _WRAPPED.get(cls)
        if wrapped is None:
          original = vars(cls)["__call__"]
          wrapped = _WRAPPED[cls] = _Wrapped(original, _dispatching(original))
          setattr(cls, "__call__", wrapped.wrapper)
        wrapped.traces += 1
        held.append(cls)
    yield
  finally:
    with _LOCK:
      for cls in held:
        wrapped = _WRAPPED[cls]
        wrapped.traces -= 1
        if wrapped.traces:
          continue
        del _WRAPPED[cls]
        # (Unless the class was given another __call__ meanwhile: that one
        # stays.)
        if vars(cls).get("__call__") is wrapped.wrapper:
          setattr(cls, "__call__", wrapped.original)


def _dispatching(original: Callable[..., Any]) -> Callable[..., Any]:
  """``original`` for every call, except in a thread that traces a step
  (outside its units' blocks), where a matching module runs as a unit."""

  @functools.wraps(original)
  def call(self, *args, **kwargs):
    context = _CONTEXT.get()
    if context is None or inside_unit():
      return original(self, *args, **kwargs)
    return _nnx_call(context, original, self, args, kwargs)

  return call


def _nnx_call(context: materialize.LossContext, original: Callable[..., Any],
              module: Any, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Any:
  from flax import nnx  # pylint: disable=g-import-not-at-top
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  if jax.tree.leaves(rest) or not _matches(context, module,
                                           jax.tree.leaves(params)):
    return original(module, *args, **kwargs)
  apply = lambda p, *a, **kw: original(nnx.merge(graphdef, p), *a, **kw)
  return run_as_unit(apply, params, args, kwargs, name=type(module).__name__)
