"""Which parameters an optax update mixes: a dataflow pass over its jaxpr.

The streamed update (``Streamer``, ``zero_jax.offload``) runs ``tx.update`` on slices of
the state, a few rows of one leaf at a time. That is exact only when no
output row depends on another row of the same leaf, and no leaf's update
depends on another leaf. This module proves both from the traced update
instead of trusting a list of optimizer names: every input array is tagged
with the parameter it belongs to and the position of that parameter's first
axis (the one that is sliced), and the tags are carried through each
primitive. A reduction over the tagged axis, or any primitive not known to
keep rows apart, *loses* the axis (the leaf is then updated whole); a value
that depends on two parameters is *cross-leaf* (a global norm), and the
update cannot be split at all.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax.extend import core



class Tag(dict):
  """``{leaf: position of its sliced axis in a value, or None}``."""

_ELEMENTWISE = frozenset("""
abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp conj
convert_element_type copy copy_p cos cosh div eq erf erf_inv erfc exp exp2
expm1 floor ge gt imag integer_pow is_finite le lgamma log log1p logistic lt
max min mul ne neg nextafter not or pow real reduce_precision rem round rsqrt
select_n sign sin sinh sqrt square stop_gradient sub tan tanh xor digamma
""".split())
_REDUCTIONS = frozenset("""
reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor
argmax argmin
""".split())
_CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


@dataclasses.dataclass
class Report:
  """What the pass found.

  Attributes:
    lost: leaves whose sliced axis some primitive mixes: update them whole.
    cross: primitives whose result depends on two or more leaves, with the
      leaves: the update cannot be split by leaf.
    out: the tag of every output, flattened.
  """
  lost: set = dataclasses.field(default_factory=set)
  cross: list = dataclasses.field(default_factory=list)
  out: list = dataclasses.field(default_factory=list)


def analyze(fn: Callable[..., Any], args: Any, tags: Any) -> Report:
  """Traces ``fn(*args)`` and follows ``tags`` through it.

  Args:
    fn: the function (e.g. ``tx.update``).
    args: its arguments (arrays or ``jax.ShapeDtypeStruct``), a tuple.
    tags: a tree like ``args`` whose leaves are ``Tag`` dicts (empty for
      data that belongs to no parameter, such as Adam's count).

  Returns:
    The ``Report``.
  """
  closed = jax.make_jaxpr(fn)(*args)
  flat = jax.tree.leaves(tags, is_leaf=lambda t: isinstance(t, Tag))
  report = Report()
  report.out = _run(closed.jaxpr, flat, report)
  return report


def _merge(tags: list[Tag], report: Report, name: str) -> Tag:
  """The tag of an elementwise result: every input's leaves; a leaf seen at
  two positions has lost its axis."""
  out: Tag = {}
  for t in tags:
    for leaf, pos in t.items():
      if leaf in out and out[leaf] != pos:
        report.lost.add(leaf)
        pos = None
      out[leaf] = pos
  if len(out) > 1:
    report.cross.append((name, frozenset(out)))
  return out


def _lose(tag: Tag, report: Report) -> Tag:
  for leaf, pos in tag.items():
    if pos is not None:
      report.lost.add(leaf)
  return {leaf: None for leaf in tag}


def _map(tag: Tag, where: Callable[[int], int | None], report: Report) -> Tag:
  """Moves each leaf's axis to ``where(pos)``; None there loses it."""
  out = {}
  for leaf, pos in tag.items():
    new = None if pos is None else where(pos)
    if pos is not None and new is None:
      report.lost.add(leaf)
    out[leaf] = new
  return out


def _reshape_pos(old: tuple, new: tuple, pos: int) -> int | None:
  """Where axis ``pos`` of ``old`` lands in ``new``, if it survives whole."""
  before = 1
  for d in old[:pos]:
    before *= d
  acc = 1
  for q, d in enumerate(new):
    if acc == before and d == old[pos]:
      return q
    acc *= d
  return None


def _run(jaxpr, in_tags: list[Tag], report: Report) -> list[Tag]:
  env: dict = {}
  read = lambda v: {} if isinstance(v, core.Literal) else env.get(v, {})
  for v, t in zip(jaxpr.invars, in_tags):
    env[v] = t
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    ins = [read(v) for v in eqn.invars]
    outs = _eqn(eqn, name, ins, report)
    for v, t in zip(eqn.outvars, outs):
      env[v] = t
  return [read(v) for v in jaxpr.outvars]


def _eqn(eqn, name: str, ins: list[Tag], report: Report) -> list[Tag]:
  n_out = len(eqn.outvars)
  if not any(ins):
    return [{}] * n_out
  p = eqn.params
  shape = lambda v: tuple(v.aval.shape)
  if name in _ELEMENTWISE:
    return [_merge(ins, report, name)] * n_out
  if name == "broadcast_in_dim":
    dims = p["broadcast_dimensions"]
    return [_map(ins[0], lambda a: dims[a], report)]
  if name == "transpose":
    perm = tuple(p["permutation"])
    return [_map(ins[0], perm.index, report)]
  if name in ("reshape", "squeeze", "expand_dims"):
    old, new = shape(eqn.invars[0]), shape(eqn.outvars[0])
    return [_map(ins[0], lambda a: _reshape_pos(old, new, a), report)]
  if name in _REDUCTIONS:
    axes = tuple(p["axes"])
    return [_map(ins[0], lambda a: None if a in axes else
                 a - sum(x < a for x in axes), report)] * n_out
  if name == "dot_general":
    (lc, rc), (lb, rb) = p["dimension_numbers"]
    nl, nr = len(shape(eqn.invars[0])), len(shape(eqn.invars[1]))
    lfree = [a for a in range(nl) if a not in lc and a not in lb]
    rfree = [a for a in range(nr) if a not in rc and a not in rb]

    def side(c, b, free, offset):
      return lambda a: (None if a in c else list(b).index(a) if a in b else
                        len(lb) + offset + free.index(a))

    left = _map(ins[0], side(lc, lb, lfree, 0), report)
    right = _map(ins[1], side(rc, rb, rfree, len(lfree)), report)
    return [_merge([left, right], report, name)]
  for key in _CALLS:
    if key in p:
      sub = p[key]
      sub = getattr(sub, "jaxpr", sub)
      return _run(sub, ins[len(ins) - len(sub.invars):], report)
  if name == "cond":
    outs = [_run(getattr(b, "jaxpr", b), ins[1:], report)
            for b in p["branches"]]
    # The branch taken depends on the index: every output depends on it.
    return [_merge([ins[0], *ts], report, name) for ts in zip(*outs)]
  # Anything else (sorts, cumulative sums, slicing, loops) may mix rows.
  return [_lose(_merge(ins, report, name), report)] * n_out
