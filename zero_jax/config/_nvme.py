"""The NVMe tier's options (``ZeroConfig.nvme``): how the optimizer state
on disk is cut into slices, how many slices host RAM holds, and how the
files are read and written."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from zero_jax._checks import check_bool, check_int, fail
from zero_jax.config._sections import from_mapping

_MIB = 2**20
# O_DIRECT requests start and end on the disk's logical blocks: 4 KiB
# covers every disk zero_jax meets.
ALIGN = 4096


@dataclasses.dataclass(frozen=True)
class NvmeOptions:
  """How ``offload_optimizer="nvme"`` moves state between disk and RAM.

  Attributes:
    slice_bytes: master and optimizer state of one slice, in bytes (all of
      a slice's tensors together): the unit that is read, updated and
      written while the next is read and the last written (128 MiB: 512
      MiB of RAM with 4 buffers).
    buffer_count: slices host RAM holds at once (DeepSpeed's
      ``offload_optimizer.buffer_count``): the budget is ``buffer_count *
      slice_bytes``. 3 lets the read of slice i+1 and the write of slice
      i-1 overlap the update of slice i; 1 runs them one after another.
    in_flight: I/O requests in flight at once in each direction, each
      from a thread of its own (DeepSpeed's ``aio.intra_op_parallelism *
      aio.queue_depth``).
    block_bytes: the largest request, a multiple of 4096 (DeepSpeed's
      ``aio.block_size``).
    read_ahead: read slice i+1 while slice i is updated (DeepSpeed's
      ``pipeline_read``); False reads each slice when its update starts.
    write_behind: write slice i while slice i+1 is updated (DeepSpeed's
      ``pipeline_write``); False waits for each write before going on.
    direct: open the files with ``O_DIRECT`` (past the page cache, which
      would otherwise hold what was written and count as the process's
      memory); False reads and writes through the page cache.
    resume: what ``engine.init`` does where ``nvme_path`` holds the
      committed state of an earlier run: None (the default) raises an
      error naming both choices, True resumes it (the step, the loss
      scale and the state, bit for bit; a new run where there is none),
      False starts afresh over it.
  """

  slice_bytes: int = 128 * _MIB
  buffer_count: int = 4
  in_flight: int = 8
  block_bytes: int = 8 * _MIB
  read_ahead: bool = True
  write_behind: bool = True
  direct: bool = True
  resume: bool | None = None

  def __post_init__(self):
    check = lambda name, f, *a, **k: object.__setattr__(
        self, name, f(f"NvmeOptions.{name}", getattr(self, name), *a, **k))
    check("slice_bytes", check_int, ALIGN,
          fix="slices are at least 4096 bytes; 128 MiB (the default) keeps "
          "requests large and the budget small")
    check("buffer_count", check_int, 1,
          fix="3 or more overlaps reads and writes with the update")
    check("in_flight", check_int, 1, 1024,
          fix="8 (the default) suits one NVMe drive")
    check("block_bytes", check_int, ALIGN,
          fix="1 MiB to 8 MiB suits NVMe drives")
    if self.block_bytes % ALIGN:
      fail("NvmeOptions.block_bytes", "a multiple of 4096",
           self.block_bytes, "O_DIRECT requests are whole 4 KiB blocks")
    for name in ("read_ahead", "write_behind", "direct"):
      check(name, check_bool)
    if self.resume is not None:
      check("resume", check_bool,
            "None raises where nvme_path holds an earlier run's state; True "
            "resumes it, False starts afresh")

  @property
  def budget_bytes(self) -> int:
    """Host RAM the slices take: ``buffer_count * slice_bytes``."""
    return self.buffer_count * self.slice_bytes

  @classmethod
  def of(cls, value: Any) -> "NvmeOptions":
    """``value`` (options, a mapping of their fields, or None) as
    options."""
    if value is None:
      return cls()
    if isinstance(value, cls):
      return value
    if isinstance(value, Mapping):
      return from_mapping(cls, value, "NvmeOptions")
    fail("ZeroConfig.nvme", "NvmeOptions, a mapping of its fields or None",
         value, "e.g. zero_jax.NvmeOptions(buffer_count=4)")
