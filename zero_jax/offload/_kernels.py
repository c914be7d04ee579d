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

Numba is imported on first use (``kernels()``), not with the package, and
the compiled kernels are cached on disk (numba's ``cache=True``: beside
this file, or in the user's cache directory where that is read-only).
Why these forms: issue 43's measurements (float32 constants, one
``prange`` loop over the flat leaf; float64 constants, chunks through an
inner function or array expressions ran at 0.4-0.66x the speed).
"""

from __future__ import annotations

import functools
import types as _types
import numpy as np

# LLVM's fast-math flags the update loops may use: reassociation and
# contraction let the loop vectorize. Not ``nnan``/``ninf``: a master that
# holds a NaN must stay NaN, as optax leaves it.
_FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}


@functools.cache
def kernels() -> _types.SimpleNamespace:
  """The compiled kernels (numba imported and the kernels defined on first
  call; each is compiled for its argument dtypes on first use)."""
  # pylint: disable=g-import-not-at-top
  import numba
  from numba import types
  from numba.extending import intrinsic, overload

  def bitcast(src, dst):
    """An intrinsic that reads a ``src`` scalar's bits as a ``dst``."""
    @intrinsic
    def cast(typingctx, x):  # pylint: disable=unused-argument
      def codegen(context, builder, signature, args):
        del signature
        return builder.bitcast(args[0], context.get_value_type(dst))
      return dst(src), codegen
    return cast

  f32_from_bits = bitcast(types.uint32, types.float32)
  bits_from_f32 = bitcast(types.float32, types.uint32)

  jit = functools.partial(numba.njit, cache=True)

  @jit(inline="always")
  def half_to_float(h):
    h = np.uint32(h) & np.uint32(0xFFFF)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exp = (h >> np.uint32(10)) & np.uint32(0x1F)
    mant = h & np.uint32(0x3FF)
    if exp == 0:
      # Zero or subnormal: mant * 2**-24, exact in float32.
      x = np.float32(mant) * np.float32(5.9604644775390625e-08)
      return -x if sign else x
    if exp == 31:
      return f32_from_bits(sign | np.uint32(0x7F800000) |
                           (mant << np.uint32(13)))
    return f32_from_bits(sign | ((exp + np.uint32(112)) << np.uint32(23)) |
                         (mant << np.uint32(13)))

  @jit(inline="always")
  def float_to_half(x):
    # numpy's npy_floatbits_to_halfbits: round to nearest, ties to even.
    f = bits_from_f32(x)
    sign = (f & np.uint32(0x80000000)) >> np.uint32(16)
    f_exp = f & np.uint32(0x7F800000)
    if f_exp >= np.uint32(0x47800000):
      f_sig = f & np.uint32(0x007FFFFF)
      if f_exp == np.uint32(0x7F800000) and f_sig != 0:
        r = np.uint32(0x7C00) + (f_sig >> np.uint32(13))
        if r == np.uint32(0x7C00):
          r += np.uint32(1)
        return np.int16(np.uint16(sign + r))
      return np.int16(np.uint16(sign + np.uint32(0x7C00)))
    if f_exp <= np.uint32(0x38000000):
      if f_exp < np.uint32(0x33000000):
        return np.int16(np.uint16(sign))
      e = f_exp >> np.uint32(23)
      f_sig = np.uint32(0x00800000) + (f & np.uint32(0x007FFFFF))
      f_sig >>= (np.uint32(113) - e)
      if ((f_sig & np.uint32(0x3FFF)) != np.uint32(0x1000) or
          (f & np.uint32(0x7FF)) != 0):
        f_sig += np.uint32(0x1000)
      return np.int16(np.uint16(sign + (f_sig >> np.uint32(13))))
    h_exp = (f_exp - np.uint32(0x38000000)) >> np.uint32(13)
    f_sig = f & np.uint32(0x007FFFFF)
    if (f_sig & np.uint32(0x3FFF)) != np.uint32(0x1000):
      f_sig += np.uint32(0x1000)
    return np.int16(np.uint16(sign + (f_sig >> np.uint32(13)) + h_exp))

  @jit(inline="always")
  def float_to_bf16(x):
    f = bits_from_f32(x)
    if (f & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
      # The canonical quiet NaN, with the sign (as ml_dtypes casts it).
      return np.uint16(((f >> np.uint32(16)) & np.uint32(0x8000)) |
                       np.uint32(0x7FC0))
    f += np.uint32(0x7FFF) + ((f >> np.uint32(16)) & np.uint32(1))
    return np.uint16(f >> np.uint32(16))

  def widen(x):
    del x

  @overload(widen, inline="always")
  def _widen(x):
    if x == types.uint16:
      return lambda x: f32_from_bits(np.uint32(x) << np.uint32(16))
    if x == types.int16:
      return lambda x: half_to_float(x)
    return lambda x: np.float32(x)

  def store(out, i, x):
    del out, i, x

  @overload(store, inline="always")
  def _store(out, i, x):
    if out.dtype == types.boolean:  # (NOTHING: no compute copy)
      def put(out, i, x):
        pass
    elif out.dtype == types.uint16:
      def put(out, i, x):
        out[i] = float_to_bf16(x)
    elif out.dtype == types.int16:
      def put(out, i, x):
        out[i] = float_to_half(x)
    else:
      def put(out, i, x):
        out[i] = x
    return put

  par = functools.partial(jit, parallel=True, fastmath=_FAST)

  @jit(inline="always")
  def grad(g, i, divisor, norm, c):
    # prepare's unscale and optax.clip_by_global_norm's formula (norm and c
    # 1 when not clipping: exactly x, and no branch in the loop).
    return widen(g[i]) / divisor / norm * c

  @jit(inline="always")
  def applied(p, out, i, u, neg_lr):
    # scale_by_learning_rate, optax.apply_updates; then the compute copy.
    x = p[i] + u * neg_lr
    p[i] = x
    store(out, i, x)

  @jit(inline="always")
  def decayed(p, out, i, u, wd, neg_lr):
    # add_decayed_weights first.
    applied(p, out, i, u + wd * p[i], neg_lr)

  @jit(inline="always")
  def l2_grad(g, p, i, divisor, norm, c, l2):
    # The gradient with L2 decay added (DeepSpeed's Adam without
    # adam_w_mode, torch's SGD and Adagrad).
    d = grad(g, i, divisor, norm, c)
    if l2 != 0:
      d = d + l2 * p[i]
    return d

  # (Reassociation lets the float64 sum vectorize: 4x faster on bf16.)
  @jit(parallel=True, fastmath={"reassoc", "contract"})
  def sumsq(g):
    """The sum of squares of a gradient leaf, in float64 (non-finite if
    any element is)."""
    total = 0.0
    for i in numba.prange(g.shape[0]):
      x = np.float64(widen(g[i]))
      total += x * x
    return total

  @par
  def adam(p, g, m, v, out, divisor, norm, c, neg_lr, b1, b2, eps,
           eps_root, wd, bc1, bc2, l2):
    """optax.scale_by_adam, then add_decayed_weights (wd), then
    scale_by_learning_rate; ``out`` NOTHING: no compute copy. ``l2``:
    DeepSpeed's Adam without adam_w_mode, the decay added to the
    gradient."""
    one = np.float32(1)
    for i in numba.prange(p.shape[0]):
      gi = l2_grad(g, p, i, divisor, norm, c, l2)
      mi = (one - b1) * gi + b1 * m[i]
      vi = (one - b2) * (gi * gi) + b2 * v[i]
      m[i] = mi
      v[i] = vi
      decayed(p, out, i, (mi / bc1) / (np.sqrt(vi / bc2 + eps_root) + eps),
              wd, neg_lr)

  @par
  def lion(p, g, m, out, divisor, norm, c, neg_lr, b1, b2, wd,
           down_at_zero):
    """optax.scale_by_lion (hard), add_decayed_weights, the learning rate.
    ``down_at_zero``: DeepSpeed's FusedLion, whose direction is -1 (not 0)
    where the interpolation is 0."""
    one = np.float32(1)
    for i in numba.prange(p.shape[0]):
      gi = grad(g, i, divisor, norm, c)
      mi = m[i]
      x = (one - b1) * gi + b1 * mi
      u = np.float32(np.sign(x))
      if down_at_zero and x <= 0:
        u = -one
      m[i] = (one - b2) * gi + b2 * mi
      decayed(p, out, i, u, wd, neg_lr)

  @par
  def sgd(p, g, t, out, divisor, norm, c, neg_lr, momentum, nesterov):
    """optax.sgd: optax.trace (``t`` empty: no momentum), the learning
    rate."""
    trace = t.shape[0] == p.shape[0]
    for i in numba.prange(p.shape[0]):
      u = grad(g, i, divisor, norm, c)
      if trace:
        ti = u + momentum * t[i]
        t[i] = ti
        u = u + momentum * ti if nesterov else ti
      applied(p, out, i, u, neg_lr)

  @par
  def adagrad(p, g, s, out, divisor, norm, c, neg_lr, eps):
    """optax.scale_by_rss, the learning rate."""
    zero = np.float32(0)
    one = np.float32(1)
    for i in numba.prange(p.shape[0]):
      gi = grad(g, i, divisor, norm, c)
      si = gi * gi + s[i]
      s[i] = si
      r = one / np.sqrt(si + eps) if si > zero else zero
      applied(p, out, i, r * gi, neg_lr)

  @par
  def torch_sgd(p, g, buf, out, divisor, norm, c, neg_lr, l2, momentum,
                one_minus_damp, first, nesterov):
    """torch.optim.SGD (DeepSpeed's SGD): ``d = g + l2 p``; the buffer
    starts as ``d`` (``first``), then ``momentum b + (1 - dampening) d``;
    the update is ``d + momentum b`` (``nesterov``) or ``b``; ``buf``
    NOTHING: no momentum."""
    trace = buf.shape[0] == p.shape[0]
    for i in numba.prange(p.shape[0]):
      d = l2_grad(g, p, i, divisor, norm, c, l2)
      u = d
      if trace:
        b = d if first else momentum * buf[i] + one_minus_damp * d
        buf[i] = b
        u = d + momentum * b if nesterov else b
      applied(p, out, i, u, neg_lr)

  @par
  def torch_adagrad(p, g, s, out, divisor, norm, c, neg_lr, l2, eps, decay):
    """torch.optim.Adagrad (DeepSpeed's Adagrad): ``d = g + l2 p``; ``s +=
    d^2``; the update ``d / (sqrt(s) + eps) / decay``."""
    for i in numba.prange(p.shape[0]):
      d = l2_grad(g, p, i, divisor, norm, c, l2)
      si = s[i] + d * d
      s[i] = si
      applied(p, out, i, d / (np.sqrt(si) + eps) / decay, neg_lr)

  @par
  def cast(p, out):
    """The compute copy alone (after a restore, or a skipped step)."""
    for i in numba.prange(p.shape[0]):
      store(out, i, p[i])

  return _types.SimpleNamespace(sumsq=sumsq, adam=adam, lion=lion, sgd=sgd,
                                adagrad=adagrad, torch_sgd=torch_sgd,
                                torch_adagrad=torch_adagrad, cast=cast,
                                set_threads=numba.set_num_threads,
                                max_threads=numba.config.NUMBA_NUM_THREADS)


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
