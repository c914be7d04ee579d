"""Host buffers that zero_jax owns: page-aligned numpy arrays (what the
fused host optimizer's kernels read and write, and what JAX's CPU devices
take as their own buffers without a copy)."""

from __future__ import annotations

from typing import Any

import numpy as np

_PAGE = 4096


def aligned(shape: tuple, dtype: Any) -> np.ndarray:
  """An uninitialized array of ``shape`` and ``dtype`` whose data starts on
  a page boundary (what O_DIRECT I/O and the kernels' vector loads want)."""
  dtype = np.dtype(dtype)
  n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.empty(n + _PAGE, np.uint8)
  start = -raw.ctypes.data % _PAGE
  return raw[start:start + n].view(dtype).reshape(shape)


def owned(x: Any, dtype: Any = None) -> np.ndarray:
  """``x`` copied into an aligned array (in ``dtype``, default its own)."""
  x = np.asarray(x)
  out = aligned(x.shape, dtype or x.dtype)
  np.copyto(out, x, casting="unsafe")
  return out
