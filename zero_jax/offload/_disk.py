"""Reads and writes of the NVMe tier's files: large aligned requests from a
thread pool, each length checked.

Every request is an ``os.preadv`` or ``os.pwritev`` of whole 4 KiB blocks
on a file opened with ``O_DIRECT`` (past the page cache, where the host
supports it). Python's calls release the GIL for the I/O, so ``in_flight``
threads keep that many requests in flight, the disk's queue full, while
the update runs on other cores. A read or write that moves fewer bytes
than asked raises ``DiskError`` naming the file, the offset and both
counts: a truncated file is found where it is read, not as wrong numbers.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import pathlib
import threading
from typing import Callable

import numpy as np

from zero_jax.offload import _kernels

_DIRECT = getattr(os, "O_DIRECT", 0)


class DiskError(OSError):
  """A read or write of the NVMe tier moved fewer bytes than asked, or a
  file does not hold what its manifest says (a torn or flipped slice)."""


class File:
  """One state file, open for aligned reads and writes.

  Args:
    path: the file.
    size: its size in bytes (a multiple of 4096); a new file is made this
      large (sparse), an existing one must be (or is made so: ``resize``).
    direct: open with ``O_DIRECT`` where the file system takes it.
    resize: an existing file of another size is cut or grown to ``size``
      (its content is to be written anew).
  """

  def __init__(self, path: pathlib.Path, size: int, direct: bool,
               resize: bool = False):
    self.path, self.size = path, size
    flags = os.O_RDWR | os.O_CREAT
    self.direct = bool(direct and _DIRECT)
    try:
      self.fd = os.open(path, flags | (_DIRECT if self.direct else 0), 0o600)
    except OSError as e:
      if e.errno != errno.EINVAL or not self.direct:
        raise
      # (tmpfs and some network file systems refuse O_DIRECT: said by
      # ``direct``, which describe() shows.)
      self.direct = False
      self.fd = os.open(path, flags, 0o600)
    have = os.fstat(self.fd).st_size
    if (have == 0 or resize) and have != size:
      os.ftruncate(self.fd, size)
    elif have != size:
      os.close(self.fd)
      raise DiskError(
          errno.EIO, f"{path} holds {have:,} bytes where the NVMe tier's "
          f"layout has {size:,} (a file of another model, or cut short): "
          "point nvme_path at an empty directory, or restore from a "
          "checkpoint")

  def read(self, buf: np.ndarray, offset: int) -> None:
    """Fills ``buf`` (aligned, contiguous) from ``offset``."""
    self._move(os.preadv, "short read of", buf, offset, lambda: (
        f"the file is {os.fstat(self.fd).st_size:,} bytes; truncated?"))

  def write(self, buf: np.ndarray, offset: int) -> None:
    """Writes ``buf`` (aligned, contiguous) at ``offset``."""
    self._move(os.pwritev, "short write to", buf, offset,
               lambda: "disk full?")

  def _move(self, call: Callable, what: str, buf: np.ndarray, offset: int,
            why: Callable[[], str]) -> None:
    """One request; fewer bytes than asked is a ``DiskError``."""
    view = memoryview(buf.reshape(-1).view(np.uint8))
    n = call(self.fd, [view], offset)
    if n != len(view):
      raise DiskError(
          errno.EIO, f"{what} {self.path}: {n:,} of {len(view):,} bytes at "
          f"offset {offset:,} ({why()})")

  def sync(self) -> None:
    """Flushes what was written to the disk itself (``fsync``)."""
    os.fsync(self.fd)

  def close(self) -> None:
    if self.fd >= 0:
      os.close(self.fd)
      self.fd = -1


class Pool:
  """The I/O threads: each request runs on one, ``in_flight`` reads and
  ``in_flight`` writes at a time (reads do not queue behind writes).

  Args:
    in_flight: threads per direction, so requests in flight.
    block_bytes: the largest request; bigger reads and writes are split.
  """

  def __init__(self, in_flight: int, block_bytes: int):
    self.block_bytes = block_bytes
    self._reads, self._writes = (concurrent.futures.ThreadPoolExecutor(
        in_flight, thread_name_prefix=f"zero_jax-nvme-{d}")
                                 for d in ("read", "write"))
    self._lock = threading.Lock()
    self._sum = _kernels.kernels().checksum
    self.bytes_read = self.bytes_written = 0

  def _split(self, buf: np.ndarray) -> list[tuple[int, np.ndarray]]:
    flat = buf.reshape(-1).view(np.uint8)
    step = self.block_bytes
    return [(i, flat[i:i + step]) for i in range(0, flat.size, step)]

  def _count(self, read: int, written: int) -> None:
    with self._lock:
      self.bytes_read += read
      self.bytes_written += written

  def read(self, file: File, buf: np.ndarray, offset: int,
           sums: list[int] | None = None, step: int | None = None
           ) -> list[concurrent.futures.Future]:
    """Starts reading ``buf`` from ``file`` at ``offset``, a request per
    block, each checked against its checksum in ``sums`` (None: not
    checked) as soon as it arrives; ``step``: the committed step the file
    holds, for the error."""
    return [self._reads.submit(self._read, file, b, offset + i,
                               None if sums is None else sums[n], step)
            for n, (i, b) in enumerate(self._split(buf))]

  def _read(self, file: File, b: np.ndarray, offset: int,
            expect: int | None, step: int | None) -> None:
    file.read(b, offset)
    self._count(b.size, 0)
    if expect is not None and self.checksum(b) != expect:
      raise DiskError(
          errno.EIO, f"{file.path}: the {b.size:,} bytes at offset "
          f"{offset:,} do not match their checksum of step {step} (a torn "
          "or changed file): restore the state from a checkpoint")

  def write(self, file: File, buf: np.ndarray, offset: int
            ) -> list[concurrent.futures.Future]:
    """Starts writing ``buf`` to ``file`` at ``offset``, a request per
    block; each future's result is its block's checksum."""
    return [self._writes.submit(self._write, file, b, offset + i)
            for i, b in self._split(buf)]

  def _write(self, file: File, b: np.ndarray, offset: int) -> int:
    file.write(b, offset)
    self._count(0, b.size)
    return self.checksum(b)

  def checksum(self, b: np.ndarray) -> int:
    """``b``'s checksum (``_loops.checksum``: whole 8-byte words)."""
    return int(self._sum(b.view(np.uint64)))

  def run(self, fn: Callable[[], object]) -> concurrent.futures.Future:
    """Runs ``fn`` on a writing thread (a sync)."""
    return self._writes.submit(fn)

  def close(self) -> None:
    for threads in (self._reads, self._writes):
      threads.shutdown(wait=True)


def done(futures: list[concurrent.futures.Future]) -> None:
  """Waits for every one of ``futures``; the first error is raised (after
  all have finished, so no request still writes a buffer being reused)."""
  concurrent.futures.wait(futures)
  for f in futures:
    f.result()


def sync_directory(path: pathlib.Path) -> None:
  """Makes a rename or a new file in directory ``path`` durable."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def done_quietly(futures: list[concurrent.futures.Future]) -> None:
  """Waits for every one of ``futures``, their errors dropped (another
  error is being raised)."""
  concurrent.futures.wait(futures)


def close_all(pool: Pool | None, files: dict) -> None:
  """Stops ``pool``'s threads and closes ``files`` (a dict of ``File``)."""
  if pool is not None:
    pool.close()
  for f in files.values():
    f.close()
  files.clear()
