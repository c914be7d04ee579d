"""Where the NVMe tier keeps each tensor: the files' layout and the slices
an update reads, updates and writes in turn.

Every tensor kind (the fp32 master, then each parameter-shaped part of the
optimizer state: Adam's mu, then nu) has a file per version, holding every
leaf flat, one after another, each starting on a 4 KiB boundary of every
kind's file (as ``O_DIRECT`` needs). A slice is a run of elements of that
space, aligned alike, the same in every kind's file: its leaves' pieces
(``Segment``) are what the kernels update.
"""

from __future__ import annotations

import dataclasses

import numpy as np

ALIGN = 4096


@dataclasses.dataclass(frozen=True)
class Segment:
  """A piece of a leaf inside a slice.

  Attributes:
    leaf: the leaf's index (tree order).
    lo, hi: its elements ``[lo, hi)`` of the flat leaf.
    at: where they start in the slice's buffers (elements).
  """

  leaf: int
  lo: int
  hi: int
  at: int


@dataclasses.dataclass(frozen=True)
class Slice:
  """Elements ``[start, stop)`` of every kind's file, and their leaves."""

  start: int
  stop: int
  segments: tuple[Segment, ...]

  @property
  def size(self) -> int:
    return self.stop - self.start


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class DiskPlan:
  """The files' layout and the slices.

  Attributes:
    sizes: elements per leaf.
    dtypes: each kind's dtype (master first).
    offsets: where each leaf starts, in elements.
    total: elements per file (the leaves and their padding).
    slice_elements: elements per slice (the last may hold fewer).
    slices: every slice, in order.
  """

  sizes: tuple[int, ...]
  dtypes: tuple[np.dtype, ...]
  offsets: tuple[int, ...]
  total: int
  slice_elements: int
  slices: tuple[Slice, ...]

  @classmethod
  def of(cls, sizes: list[int], dtypes: list[np.dtype],
         slice_bytes: int) -> "DiskPlan":
    """The layout of leaves of ``sizes`` elements in kinds of ``dtypes``,
    cut into slices of at most ``slice_bytes`` (every kind together; at
    least 4 KiB of each)."""
    # (Elements per 4 KiB of the narrowest kind: every kind's offsets are
    # then whole 4 KiB blocks.)
    align = ALIGN // min(np.dtype(d).itemsize for d in dtypes)
    offsets, at = [], 0
    for n in sizes:
      offsets.append(at)
      at += _round_up(max(n, 1), align)
    per = sum(np.dtype(d).itemsize for d in dtypes)
    s = min(max(align, slice_bytes // per // align * align), at)
    slices = []
    for start in range(0, at, s):
      stop = min(start + s, at)
      segs = tuple(Segment(j, max(start, o) - o, min(stop, o + n) - o,
                           max(start, o) - start)
                   for j, (o, n) in enumerate(zip(offsets, sizes))
                   if o < stop and o + n > start)
      slices.append(Slice(start, stop, segs))
    return cls(tuple(sizes), tuple(np.dtype(d) for d in dtypes),
               tuple(offsets), at, s, tuple(slices))

  def file_bytes(self, kind: int) -> int:
    """The size of kind ``kind``'s file."""
    return self.total * self.dtypes[kind].itemsize

  def last_slice(self) -> list[int]:
    """Per leaf, the slice that holds its last element."""
    last = [0] * len(self.sizes)
    for i, sl in enumerate(self.slices):
      for seg in sl.segments:
        last[seg.leaf] = i
    return last

  def signature(self) -> dict:
    """What a committed state must match to be read with this plan."""
    return {"sizes": list(self.sizes),
            "dtypes": [d.name for d in self.dtypes],
            "slice_elements": self.slice_elements}
