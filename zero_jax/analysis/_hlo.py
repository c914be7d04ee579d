"""Collectives in a compiled step's HLO text, with loop trip counts.

Counts each all-gather / reduce-scatter / all-reduce / all-to-all /
collective-permute with its result shape. A collective inside a while loop
(a scan over layers or micro-batches) is weighted by the loop's
``known_trip_count``, nested loops multiplying, so totals are per step.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
          "collective-permute")
_DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "s32": 4,
                "u32": 4, "s8": 1, "u8": 1, "pred": 1, "s16": 2, "u16": 2,
                "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
# "%name = f32[16,8]{1,0} all-gather(...)" and tuple results
# "%name = (f32[8]{0}, /*index=1*/f32[4]{0}) all-reduce(...)" (the combiner
# merges many into one tuple); async pairs appear as
# "-start"/"-done": only the start is counted.
_LINE = re.compile(
    r"=\s*(?P<result>\(.*\)|\S+)\s+(?P<kind>" + "|".join(_KINDS) +
    r")(?P<start>-start)?\(")
# One array: element type, dimensions and layout (``S(5)`` in it: host
# memory).
_ARRAY = re.compile(r"(?P<dtype>[a-z0-9]+)\[(?P<dims>[0-9,]*)\]"
                    r"(?:\{(?P<layout>[^}]*)\})?")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective op in the HLO.

  Attributes:
    kind: e.g. ``"all-gather"``.
    shapes: result shapes (a tuple result has several).
    dtypes: result element types, HLO spelling (``f32``, ``bf16``).
    elements: total result elements, per execution.
    bytes: total result bytes, per execution.
    executions: how often one step runs it (product of enclosing loops'
      trip counts).
    groups: its replica groups, as device ids (None where the HLO gives
      none, or a form this parser does not read).
  """

  kind: str
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]
  elements: int
  bytes: int
  executions: int = 1
  groups: tuple[tuple[int, ...], ...] | None = None

  def axes(self, mesh) -> tuple[str, ...] | None:
    """The mesh axes its replica groups run along (e.g. ``("data",)`` for
    ZeRO's gathers, ``("model",)`` for tensor parallelism's), or None where
    the groups are unknown or follow no set of axes.

    Args:
      mesh: the mesh the step was compiled on.
    """
    if self.groups is None:
      return None
    return axes_of(self.groups, mesh)


# replica_groups={{0,2},{1,3}}; the iota form [4,2]<=[8] or
# [2,4]<=[4,2]T(1,0); Shardy's mesh['data'=4,'model'=2] {'data'}, with
# the mesh's devices in another order after ", device_ids=([4,2]T(1,0))".
_GROUPS = re.compile(r"replica_groups=(?P<g>\{\{[0-9,{} ]*\}\}|\{\}|"
                     r"\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?|"
                     r"mesh\[[^\]]*\](?:,\s*device_ids=\([^)]*\)\)?)?"
                     r"\s*\{[^}]*\})")


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x.strip()]


def replica_groups(line: str) -> tuple[tuple[int, ...], ...] | None:
  """The replica groups of one HLO collective line, as device ids (None
  where it has none this parser reads)."""
  m = _GROUPS.search(line)
  if not m:
    return None
  g = m.group("g")
  if g.startswith("{"):
    return tuple(tuple(_ints(x)) for x in re.findall(r"\{([0-9, ]+)\}", g))
  if g.startswith("["):
    it = re.match(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", g)
    shape, dims = _ints(it.group(1)), _ints(it.group(2))
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if it.group(3):
      ids = ids.transpose(_ints(it.group(3)))
    ids = ids.reshape(shape)
    return tuple(tuple(int(i) for i in row)
                 for row in ids.reshape(-1, shape[-1]))
  mm = re.match(r"mesh\[([^\]]*)\](?:,\s*device_ids=\((?P<ids>[^{]*)\))?"
                r"\s*\{([^}]*)\}", g)
  sizes = [(a.strip().strip("'\""), int(n)) for a, n in
           (x.split("=") for x in mm.group(1).split(",") if x.strip())]
  along = [_sub_axis(a) for a in mm.group(3).split(",") if a.strip()]
  if None in along:
    return None
  count = int(np.prod([n for _, n in sizes]))
  ids = np.arange(count)
  if mm.group("ids"):
    it = re.match(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", mm.group("ids"))
    if it is None:
      return None
    ids = ids.reshape(_ints(it.group(1)))
    if it.group(2):
      ids = ids.transpose(_ints(it.group(2)))
  # Each mesh axis split into the sub-axes the groups name (major first),
  # so that a group along a sub-axis is a group along one dimension.
  dims: list[tuple[str, int, int]] = []  # (axis, pre-size, size)
  for name, n in sizes:
    cuts = sorted({1, n} | {c for a, pre, size in along
                            if a == name and size is not None
                            for c in (pre, pre * size)})
    if any(hi % lo for lo, hi in zip(cuts, cuts[1:])) or cuts[-1] != n:
      return None
    dims += [(name, lo, hi // lo) for lo, hi in zip(cuts, cuts[1:])]
  ids = ids.reshape([size for _, _, size in dims] or [1])
  picked = []
  for axis, pre, size in along:
    span = [i for i, (a, p, _) in enumerate(dims)
            if a == axis and (size is None or pre <= p < pre * size)]
    if not span:
      return None
    picked += span
  keep = [i for i in range(len(dims)) if i not in picked]
  k = int(np.prod([dims[i][2] for i in picked])) if picked else 1
  moved = ids.transpose(keep + picked) if dims else ids
  return tuple(tuple(int(i) for i in row) for row in moved.reshape(-1, k))


def _sub_axis(text: str) -> tuple[str, int, int | None] | None:
  """One axis of Shardy's replica groups: ``'data'`` (the whole axis:
  size None) or ``'data':(1)4``, a sub-axis: of size 4, after sub-axes of
  product 1 (the major part of the axis). None where unreadable."""
  m = re.fullmatch(r"\s*['\"]?([^'\":]+)['\"]?\s*(?::\((\d+)\)(\d+))?\s*",
                   text)
  if m is None:
    return None
  if m.group(2) is None:
    return m.group(1), 1, None
  return m.group(1), int(m.group(2)), int(m.group(3))


def axes_of(groups: tuple[tuple[int, ...], ...], mesh
            ) -> tuple[str, ...] | None:
  """The mesh axes along which ``groups`` run: the set of axes whose
  groups of ``mesh`` are exactly these, or None. (An SPMD program's
  replica groups number the devices by their place in the mesh.)"""
  import itertools  # pylint: disable=g-import-not-at-top
  ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
  names = tuple(mesh.axis_names)
  want = sorted(tuple(sorted(g)) for g in groups)
  for r in range(1, len(names) + 1):
    for along in itertools.combinations(names, r):
      keep = [names.index(a) for a in names if a not in along]
      moved = ids.transpose(keep + [names.index(a) for a in along])
      k = int(np.prod([mesh.shape[a] for a in along]))
      mine = sorted(tuple(sorted(int(i) for i in row))
                    for row in moved.reshape(-1, k))
      if mine == want:
        return along
  return None


_HEADER = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[^\s(]+)\s*\(")
_WHILE_BODY = re.compile(r"\bbody=%(?P<name>[^\s,]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')
_CALLEE = re.compile(
    r"\b(?:calls|to_apply|true_computation|false_computation)=%"
    r"(?P<name>[^\s,]+)|\bbranch_computations=\{(?P<list>[^}]*)\}")


def arrays(text: str) -> list[tuple[str, tuple[int, ...], str]]:
  """``(dtype, dims, layout)`` of every array in an HLO shape's text, in
  order (a tuple's elements one by one; layout "" where none is given)."""
  return [(a.group("dtype"),
           tuple(int(d) for d in a.group("dims").split(",") if d),
           a.group("layout") or "") for a in _ARRAY.finditer(text)]


def _parse(line: str, m: re.Match) -> Collective:
  result = m.group("result")
  shapes, dtypes, elements, nbytes = [], [], 0, 0
  found = arrays(result)
  if m.group("start") and len(found) > 1:
    # async start returns (operand, result): keep the result only.
    found = found[len(found) // 2:]
  for dtype, dims, _ in found:
    size = int(np.prod(dims, dtype=np.int64))
    shapes.append(dims)
    dtypes.append(dtype)
    elements += size
    nbytes += size * dtype_bytes(dtype)
  return Collective(m.group("kind"), tuple(shapes), tuple(dtypes), elements,
                    nbytes, groups=replica_groups(line))


def computation_name(line: str) -> str | None:
  """The name of the computation a line of HLO text opens, or None."""
  h = _HEADER.match(line)
  return h.group("name") if h else None


def _computations(hlo_text: str, follow_fusions: bool = True
                  ) -> tuple[str | None, dict[str, list[tuple[str, int]]]]:
  """(the entry's name, {computation: [(callee, times per call)]}).

  ``follow_fusions=False`` leaves out what ``calls=`` names (fusions and
  async wrappers), whose instructions are counted where they are called.
  """
  callees: dict[str, list[tuple[str, int]]] = {}
  entry, current = None, None
  for line in hlo_text.splitlines():
    name = computation_name(line)
    if name is not None:
      current = name
      callees[current] = []
      if line.startswith("ENTRY"):
        entry = current
      continue
    if current is None:
      continue
    w = _WHILE_BODY.search(line)
    if w and " while(" in line:
      t = _TRIP.search(line)
      # An unknown trip count is counted once (a lower bound).
      callees[current].append((w.group("name"),
                               int(t.group("n")) if t else 1))
    for c in _CALLEE.finditer(line):
      if not follow_fusions and c.group(0).startswith("calls="):
        continue
      names = ([c.group("name")] if c.group("name") else
               [x.strip().lstrip("%") for x in c.group("list").split(",")])
      callees[current].extend((n, 1) for n in names if n)
  return entry, callees


def executions(hlo_text: str, follow_fusions: bool = True) -> dict[str, int]:
  """How often one step runs each computation: the entry once, a while
  body as often as its loop's known trip count, nested loops multiplying.

  Args:
    hlo_text: ``compiled.as_text()``.
    follow_fusions: also count the computations of fusions and async
      wrappers (``calls=``).

  Returns:
    ``{computation name: executions}``; computations never reached from the
    entry are absent. Without an entry (a bare snippet), empty.
  """
  entry, callees = _computations(hlo_text, follow_fusions)
  out: dict[str, int] = {}

  def visit(name: str, times: int) -> None:
    if name not in callees:
      return
    out[name] = out.get(name, 0) + times
    for callee, n in callees[name]:
      visit(callee, times * n)

  if entry is not None:
    visit(entry, 1)
  return out


def dtype_bytes(dtype: str) -> int:
  """Bytes of one element of an HLO element type (``f32``: 4)."""
  return _DTYPE_BYTES.get(dtype, 4)


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective in ``compiled.as_text()``, with its executions/step."""
  ops: dict[str, list[Collective]] = {}
  current = None
  for line in hlo_text.splitlines():
    name = computation_name(line)
    if name is not None:
      current = name
      ops[current] = []
      continue
    m = _LINE.search(line)
    if current is not None and m:
      ops[current].append(_parse(line, m))
  times = executions(hlo_text)
  if not times:  # a bare snippet: every line counts once.
    return [op for found in ops.values() for op in found] or [
        _parse(line, m) for line in hlo_text.splitlines()
        if (m := _LINE.search(line))]
  out = []
  for name, n in times.items():
    out.extend(dataclasses.replace(op, executions=n) for op in ops[name])
  return out


def summarize(hlo_text: str) -> dict[str, dict[str, int]]:
  """Per step: {kind: {"count", "elements", "bytes"}}, loops unrolled."""
  s: dict[str, dict[str, int]] = {}
  for c in collectives(hlo_text):
    d = s.setdefault(c.kind, {"count": 0, "elements": 0, "bytes": 0})
    d["count"] += c.executions
    d["elements"] += c.elements * c.executions
    d["bytes"] += c.bytes * c.executions
  return s


def summarize_by_dtype(hlo_text: str) -> dict[tuple[str, str], dict[str, int]]:
  """Per step: {(kind, dtype): {"count", "elements", "bytes"}}, loops
  unrolled; a tuple collective counts once under each dtype it carries."""
  s: dict[tuple[str, str], dict[str, int]] = {}
  for c in collectives(hlo_text):
    for dtype in sorted(set(c.dtypes)):
      n = sum(int(np.prod(shape, dtype=np.int64))
              for shape, dt in zip(c.shapes, c.dtypes) if dt == dtype)
      d = s.setdefault((c.kind, dtype), {"count": 0, "elements": 0,
                                         "bytes": 0})
      d["count"] += c.executions
      d["elements"] += n * c.executions
      d["bytes"] += n * dtype_bytes(dtype) * c.executions
  return s


def closing_paren(text: str, start: int) -> int:
  """Index of the parenthesis closing the one opened at ``text[start]``
  (the last index of ``text`` if it never closes)."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] == "(":
      depth += 1
    elif text[i] == ")":
      depth -= 1
      if depth == 0:
        return i
  return len(text) - 1


def sent_across_nodes(hlo_text: str, gpus_per_node: int) -> int:
  """Bytes each device sends per step in collectives whose replica groups
  span nodes of ``gpus_per_node`` consecutive devices (groups the parser
  cannot read count as spanning). Per collective, from its result's bytes
  B in groups of g (ring algorithms): all-gather and all-to-all send
  B (g-1)/g, reduce-scatter B (g-1), all-reduce 2 B (g-1)/g.

  Args:
    hlo_text: a compiled step's HLO.
    gpus_per_node: devices per node, numbered node by node.
  """
  total = 0.0
  for c in collectives(hlo_text):
    if c.groups is not None and all(
        len({d // gpus_per_node for d in g}) == 1 for g in c.groups):
      continue
    g = len(c.groups[0]) if c.groups else 2
    share = {"reduce-scatter": g - 1, "all-reduce": 2 * (g - 1) / g}.get(
        c.kind, (g - 1) / g)
    total += c.bytes * c.executions * share
  return int(total)
