"""The fused host optimizer's kernels, in numba: one pass over memory per
update, multi-threaded, in place.

Each kernel reads a gradient leaf (float32, or 16-bit widened exactly as it
reads it), unscales and clips it, updates the fp32 master and the
optimizer state in place, and writes the 16-bit compute copy in the same
pass with round-to-nearest-even (bit for bit XLA's and numpy's casts). The
arithmetic is optax's, operation for operation; the scalars (learning
rate, bias corrections) come from the caller.

16-bit arrays travel as integer views, their kind told by the view's
dtype (numba has no 16-bit floats): ``uint16`` is bfloat16, ``int16`` is
float16. ``widen`` and ``narrow`` pick the conversion when a kernel is
compiled for a dtype, so the loop has no branch on it.

Numba is imported on first use (``kernels()`` imports ``_loops``), not
with the package, and the compiled kernels are cached on disk (numba's
``cache=True``: beside ``_loops``, or in the user's cache directory where
that is read-only; a second process loads them, tested).

One kernel, ``update``, makes every optimizer's pass: each thread takes a
contiguous run of blocks of ``BLOCK`` elements, computes a block's
compute copy into a stack buffer and streams it to the copy with
non-temporal stores (x86, a copy on 32 bytes), so the copy's lines are not
read before they are overwritten: 30 bytes a parameter for AdamW with a
bf16 copy, not 32. Why these forms: issue 43's measurements (float32
constants, loops the compiler vectorizes; float64 constants, chunks
through an inner function or array expressions ran at 0.4-0.66x the
speed).
"""

from __future__ import annotations

import functools
import types as _types
from typing import Any

import numpy as np

from zero_jax.offload._optimizers import HostRule, Kind


@functools.cache
def kernels() -> _types.SimpleNamespace:
  """The compiled kernels (numba imported and the kernels defined on first
  call; each is compiled for its argument dtypes on first use)."""
  # pylint: disable-next=g-import-not-at-top
  from zero_jax.offload import _loops
  return _types.SimpleNamespace(
      sumsq=_loops.sumsq, update=_loops.update, adam=_loops.adam,
      lion=_loops.lion, sgd=_loops.sgd, adagrad=_loops.adagrad,
      torch_sgd=_loops.torch_sgd, torch_adagrad=_loops.torch_adagrad,
      cast=_loops.cast, checksum=_loops.checksum,
      set_threads=_loops.numba.set_num_threads,
      max_threads=_loops.numba.config.NUMBA_NUM_THREADS)


def apply(k: _types.SimpleNamespace, rule: HostRule, p: np.ndarray,
          g: np.ndarray, state: list[np.ndarray], out: np.ndarray,
          scaling: tuple, coef: dict[str, Any], decays: bool) -> None:
  """One leaf's update by ``rule``'s kernel of ``k`` (``kernels()``):
  master ``p``, gradient ``g``, the leaf's parameter-shaped state, the
  compute copy ``out`` (NOTHING: none), the gradients' ``scaling``
  (divisor, norm, clip), this step's coefficients, whether the leaf
  decays."""
  neg_lr = -coef["learning_rate"]
  zero = np.float32(0)
  wd = coef.get("weight_decay", zero) if decays else zero
  kind = rule.kind
  if kind is Kind.ADAM:
    m, v = state
    k.adam(p, g, m, v, out, *scaling, neg_lr, coef["b1"], coef["b2"],
           coef["eps"], coef.get("eps_root", zero), wd, coef["bc1"],
           coef["bc2"], coef.get("l2", zero))
  elif kind is Kind.LION:
    k.lion(p, g, state[0], out, *scaling, neg_lr, coef["b1"], coef["b2"],
           wd, rule.deepspeed is not None)
  elif kind is Kind.SGD:
    t = state[0] if state else NOTHING
    k.sgd(p, g, t, out, *scaling, neg_lr,
          coef.get("momentum", np.float32(0)), rule.nesterov)
  elif kind is Kind.ADAGRAD:
    k.adagrad(p, g, state[0], out, *scaling, neg_lr, coef["eps"])
  elif kind is Kind.TORCH_SGD:
    k.torch_sgd(p, g, state[0] if state else NOTHING, out,
                *scaling, neg_lr, coef["l2"], coef["momentum"],
                coef["one_minus_damp"], bool(coef["first"]),
                bool(coef["nesterov"]))
  else:
    k.torch_adagrad(p, g, state[0], out, *scaling, neg_lr, coef["l2"],
                    coef["eps"], coef["decay"])


def as_kernel_array(x: np.ndarray) -> np.ndarray:
  """``x`` flat, 16-bit floats as the integer view the kernels read
  (bfloat16 as uint16, float16 as int16)."""
  x = x.reshape(-1)
  if x.dtype == np.float16:
    return x.view(np.int16)
  if x.dtype.name == "bfloat16":
    return x.view(np.uint16)
  return x


# What a kernel takes for an output it does not write (the compute copy,
# SGD's trace): its dtype makes the kernel compile without the store.
NOTHING = np.empty(0, np.bool_)
