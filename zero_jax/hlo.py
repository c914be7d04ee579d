"""Collectives in a compiled step's HLO text.

Counts each all-gather / reduce-scatter / all-reduce / all-to-all /
collective-permute with its result shape. Collectives inside loop bodies are
counted once per appearance in the text (trip counts are not applied here).
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
_ARRAY = re.compile(r"(?P<dtype>[a-z0-9]+)\[(?P<dims>[0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective op in the HLO.

  Attributes:
    kind: e.g. ``"all-gather"``.
    shapes: result shapes (a tuple result has several).
    dtypes: result element types, HLO spelling (``f32``, ``bf16``).
    elements: total result elements.
    bytes: total result bytes.
  """

  kind: str
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]
  elements: int
  bytes: int


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective in ``compiled.as_text()``, in order of appearance."""
  out = []
  for line in hlo_text.splitlines():
    m = _LINE.search(line)
    if not m:
      continue
    result = m.group("result")
    shapes, dtypes, elements, nbytes = [], [], 0, 0
    arrays = list(_ARRAY.finditer(result))
    if m.group("start") and len(arrays) > 1:
      # async start returns (operand, result): keep the result only.
      arrays = arrays[len(arrays) // 2:]
    for a in arrays:
      dims = tuple(int(d) for d in a.group("dims").split(",") if d)
      size = int(np.prod(dims, dtype=np.int64))
      shapes.append(dims)
      dtypes.append(a.group("dtype"))
      elements += size
      nbytes += size * _DTYPE_BYTES.get(a.group("dtype"), 4)
    out.append(Collective(m.group("kind"), tuple(shapes), tuple(dtypes),
                          elements, nbytes))
  return out


def summarize(hlo_text: str) -> dict[str, dict[str, int]]:
  """{kind: {"count", "elements", "bytes"}} over every collective."""
  s: dict[str, dict[str, int]] = {}
  for c in collectives(hlo_text):
    d = s.setdefault(c.kind, {"count": 0, "elements": 0, "bytes": 0})
    d["count"] += 1
    d["elements"] += c.elements
    d["bytes"] += c.bytes
  return s
