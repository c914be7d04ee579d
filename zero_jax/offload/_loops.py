"""The fused host optimizer's loops, in numba (imported by
``_kernels.kernels()`` on first use, never with the package).

Everything is defined at module level: numba's on-disk cache keys a
function by its code and its closure's contents, and a closure holding
numba's own objects (which pickle with a fresh id in every process) is
never found again, so every process compiled afresh and added a file.
"""

from __future__ import annotations

import functools
import platform

from llvmlite import ir
import numba
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload
import numpy as np

from zero_jax.offload._kernels import NOTHING

# The update loops take no fast-math flags: every operation rounds as
# written, in optax's order, and the loops vectorize without them.
# (Reassociation let LLVM regroup ``(1 - b2) g^2 + b2 v`` in the blocked
# loop: the second moment moved by 1e-4 relative.)

# Elements of the compute copy a kernel writes at a time (``update``).
BLOCK = 256

# Whether this host streams the copy with x86's non-temporal stores.
_X86 = platform.machine().lower() in ("x86_64", "amd64")

# Which optimizer ``update`` runs, told by the dtype of an empty array (a
# type, so each compiles a kernel of its own, cached, with no branch).
_KINDS = {name: np.empty(0, dtype) for name, dtype in [
    ("adam", np.int8), ("lion", np.int16), ("sgd", np.int32),
    ("adagrad", np.int64), ("torch_sgd", np.uint8),
    ("torch_adagrad", np.uint32), ("cast", np.uint64)]}


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

jit = functools.partial(numba.njit, cache=True, nogil=True)


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


par = functools.partial(jit, parallel=True)

# The compute copy is written a block at a time: BLOCK elements into a
# stack buffer, then the buffer to the copy with non-temporal stores,
# which skip reading the copy's lines into the cache before overwriting
# them (2 of the 32 bytes a parameter AdamW with a bf16 copy moved).
# A thread's blocks are contiguous and it fences its streamed stores once
# it is done with them, so whatever reads the copy next sees it.


@intrinsic
def scratch(typingctx, out):  # pylint: disable=unused-argument
  """A pointer to BLOCK elements of ``out``'s dtype on the stack (64-byte
  aligned; ``numba.carray`` makes it an array)."""
  def codegen(context, builder, signature, args):
    del signature, args
    data = cgutils.alloca_once(builder, context.get_data_type(out.dtype),
                               size=BLOCK)
    data.align = 64
    return data
  return types.CPointer(out.dtype)(out), codegen


@intrinsic
def streams(typingctx, out):  # pylint: disable=unused-argument
  """Whether ``out`` takes streamed blocks: a contiguous 16- or 32-bit copy
  whose data starts on 32 bytes (so every block's does), on x86."""
  def codegen(context, builder, signature, args):
    del signature
    if not (_X86 and out.layout == "C" and
            getattr(out.dtype, "bitwidth", 0) in (16, 32)):
      return cgutils.false_bit
    data = context.make_array(out)(context, builder, args[0]).data
    low = builder.and_(builder.ptrtoint(data, ir.IntType(64)),
                       ir.Constant(ir.IntType(64), 31))
    return builder.icmp_unsigned("==", low, ir.Constant(ir.IntType(64), 0))
  return types.boolean(out), codegen


@intrinsic
def stream(typingctx, out, start, tmp):  # pylint: disable=unused-argument
  """``out[start:start + BLOCK] = tmp`` by 32-byte non-temporal stores
  (``start``'s element on 32 bytes: ``streams``)."""
  def codegen(context, builder, signature, args):
    del signature
    src = context.make_array(tmp)(context, builder, args[2]).data
    dst = builder.gep(context.make_array(out)(context, builder,
                                              args[0]).data,
                      [args[1]], inbounds=True)
    chunk = ir.VectorType(ir.IntType(8), 32).as_pointer()
    src, dst = (builder.bitcast(x, chunk) for x in (src, dst))
    hint = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
    width = getattr(out.dtype, "bitwidth", 0)  # (NOTHING: no stores)
    for k in range(BLOCK * width // 8 // 32):
      at = ir.Constant(ir.IntType(64), k)
      value = builder.load(builder.gep(src, [at]), align=32)
      store = builder.store(value, builder.gep(dst, [at]), align=32)
      store.set_metadata("nontemporal", hint)
    return context.get_dummy_value()
  return types.none(out, start, tmp), codegen


@intrinsic
def sfence(typingctx):  # pylint: disable=unused-argument
  """The x86 store fence: this thread's streamed stores are visible."""
  def codegen(context, builder, signature, args):
    del signature, args
    if _X86:
      builder.call(cgutils.get_or_insert_function(
          builder.module, ir.FunctionType(ir.VoidType(), []),
          "llvm.x86.sse.sfence"), [])
    return context.get_dummy_value()
  return types.none(), codegen


def flush(out, start, tmp, count, streamed):
  del out, start, tmp, count, streamed


@overload(flush, inline="always")
def _flush(out, start, tmp, count, streamed):
  """``count`` elements from the stack to ``out`` (NOTHING: none)."""
  if out.dtype == types.boolean:
    return lambda out, start, tmp, count, streamed: None

  def put(out, start, tmp, count, streamed):
    if streamed and count == BLOCK:
      stream(out, start, tmp)
    else:
      out[start:start + count] = tmp[:count]
  return put


# The update of one element, per optimizer: it writes the master and
# the state and returns the new master. ``c``: the kernel's scalars.


def scaled(x, divisor, norm, c):
  del x, divisor, norm, c


@overload(scaled, inline="always")
def _scaled(x, divisor, norm, c):
  """prepare's unscale and optax.clip_by_global_norm's formula; ``divisor``
  None (no loss scale, no clipping: dividing by 1 is exact): ``x``, with
  no division in the loop."""
  if isinstance(divisor, types.NoneType):
    return lambda x, divisor, norm, c: x
  return lambda x, divisor, norm, c: x / divisor / norm * c


@jit(inline="always")
def grad(g, i, divisor, norm, c):
  return scaled(widen(g[i]), divisor, norm, c)


@jit(inline="always")
def applied(p, i, u, neg_lr):
  # scale_by_learning_rate, optax.apply_updates.
  x = p[i] + u * neg_lr
  p[i] = x
  return x


@jit(inline="always")
def l2_grad(g, p, i, divisor, norm, c, l2):
  # The gradient with L2 decay added (DeepSpeed's Adam without
  # adam_w_mode, torch's SGD and Adagrad).
  d = grad(g, i, divisor, norm, c)
  if l2 != 0:
    d = d + l2 * p[i]
  return d


@jit(inline="always")
def adam_at(i, p, g, m, v, c):
  # optax.scale_by_adam, then add_decayed_weights (wd), then
  # scale_by_learning_rate; ``l2``: DeepSpeed's Adam without
  # adam_w_mode, the decay added to the gradient.
  divisor, norm, cl, neg_lr, b1, b2, eps, eps_root, wd, bc1, bc2, l2 = c
  one = np.float32(1)
  gi = l2_grad(g, p, i, divisor, norm, cl, l2)
  mi = (one - b1) * gi + b1 * m[i]
  vi = (one - b2) * (gi * gi) + b2 * v[i]
  m[i] = mi
  v[i] = vi
  u = (mi / bc1) / (np.sqrt(vi / bc2 + eps_root) + eps)
  return applied(p, i, u + wd * p[i], neg_lr)


@jit(inline="always")
def lion_at(i, p, g, m, unused, c):
  # optax.scale_by_lion (hard), add_decayed_weights, the learning rate;
  # ``down``: DeepSpeed's FusedLion, whose direction is -1 (not 0) where
  # the interpolation is 0.
  divisor, norm, cl, neg_lr, b1, b2, wd, down = c
  one = np.float32(1)
  gi = grad(g, i, divisor, norm, cl)
  mi = m[i]
  x = (one - b1) * gi + b1 * mi
  u = np.float32(np.sign(x))
  if down != 0 and x <= 0:
    u = -one
  m[i] = (one - b2) * gi + b2 * mi
  return applied(p, i, u + wd * p[i], neg_lr)


@jit(inline="always")
def sgd_at(i, p, g, t, unused, c):
  # optax.sgd: optax.trace (``t`` empty: no momentum), the learning rate.
  divisor, norm, cl, neg_lr, momentum, nesterov = c
  u = grad(g, i, divisor, norm, cl)
  if t.shape[0] == p.shape[0]:
    ti = u + momentum * t[i]
    t[i] = ti
    u = u + momentum * ti if nesterov != 0 else ti
  return applied(p, i, u, neg_lr)


@jit(inline="always")
def adagrad_at(i, p, g, s, unused, c):
  # optax.scale_by_rss, the learning rate.
  divisor, norm, cl, neg_lr, eps = c
  zero = np.float32(0)
  gi = grad(g, i, divisor, norm, cl)
  si = gi * gi + s[i]
  s[i] = si
  r = np.float32(1) / np.sqrt(si + eps) if si > zero else zero
  return applied(p, i, r * gi, neg_lr)


@jit(inline="always")
def torch_sgd_at(i, p, g, buf, unused, c):
  # torch.optim.SGD (DeepSpeed's SGD): ``d = g + l2 p``; the buffer
  # starts as ``d`` (``first``), then ``momentum b + (1 - dampening) d``;
  # the update is ``d + momentum b`` (``nesterov``) or ``b``; ``buf``
  # empty: no momentum.
  divisor, norm, cl, neg_lr, l2, momentum, one_minus_damp, first, nest = c
  d = l2_grad(g, p, i, divisor, norm, cl, l2)
  u = d
  if buf.shape[0] == p.shape[0]:
    b = d if first != 0 else momentum * buf[i] + one_minus_damp * d
    buf[i] = b
    u = d + momentum * b if nest != 0 else b
  return applied(p, i, u, neg_lr)


@jit(inline="always")
def torch_adagrad_at(i, p, g, s, unused, c):
  # torch.optim.Adagrad (DeepSpeed's Adagrad): ``d = g + l2 p``; ``s +=
  # d^2``; the update ``d / (sqrt(s) + eps) / decay``.
  divisor, norm, cl, neg_lr, l2, eps, decay = c
  d = l2_grad(g, p, i, divisor, norm, cl, l2)
  si = s[i] + d * d
  s[i] = si
  return applied(p, i, d / (np.sqrt(si) + eps) / decay, neg_lr)


@jit(inline="always")
def cast_at(i, p, g, s1, s2, c):
  return p[i]


bodies = {_KINDS[name].dtype: f for name, f in [
    ("adam", adam_at), ("lion", lion_at), ("sgd", sgd_at),
    ("adagrad", adagrad_at), ("torch_sgd", torch_sgd_at),
    ("torch_adagrad", torch_adagrad_at), ("cast", cast_at)]}


def at(kind, i, p, g, s1, s2, c):
  del kind, i, p, g, s1, s2, c


@overload(at, inline="always")
def _at(kind, i, p, g, s1, s2, c):
  body = bodies[np.dtype(str(kind.dtype))]
  return lambda kind, i, p, g, s1, s2, c: body(i, p, g, s1, s2, c)


@jit
def checksum(w):
  """The NVMe tier's checksum of 64-bit words ``w``: Fletcher's two sums
  in 4 lanes, mod 2**64, mixed. A flipped bit changes it, and so does a
  block of other data (torn or stale); 8x zlib's CRC-32 on one core."""
  a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.uint64(0)
  n = w.size // 4
  for i in range(n):
    a0 += w[4 * i]
    a1 += w[4 * i + 1]
    a2 += w[4 * i + 2]
    a3 += w[4 * i + 3]
    b0 += a0
    b1 += a1
    b2 += a2
    b3 += a3
  for i in range(4 * n, w.size):
    a0 += w[i]
    b0 += a0
  h = np.uint64(0xCBF29CE484222325)
  for x in (a0, a1, a2, a3, b0, b1, b2, b3):
    h = (h ^ x) * np.uint64(0x100000001B3)
  return h


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
def update(kind, p, g, s1, s2, out, c, threads):
  """One pass of optimizer ``kind`` (a ``_KINDS`` marker) over a leaf:
  master ``p`` and state ``s1``, ``s2`` in place, the compute copy into
  ``out`` (NOTHING: none), on ``threads`` threads (numba's number:
  each takes one contiguous run of blocks)."""
  n = p.shape[0]
  blocks = -(-n // BLOCK)  # (the last one may be short)
  streamed = streams(out)
  for t in numba.prange(threads):
    tmp = numba.carray(scratch(out), BLOCK)
    for b in range(blocks * t // threads, blocks * (t + 1) // threads):
      start = b * BLOCK
      count = min(BLOCK, n - start)
      end = start + count
      # (Indexed within slices: LLVM vectorizes the loop over them.)
      pb, gb = p[start:end], g[start:end]
      ab, bb = s1[start:end], s2[start:end]
      for j in range(count):
        store(tmp, j, at(kind, j, pb, gb, ab, bb, c))
      flush(out, start, tmp, count, streamed)
    if streamed:
      sfence()


def run(name, p, g, s1, s2, out, c):
  """``update`` of the optimizer ``name`` on numba's threads (``c``: the
  scalars, the gradients' divisor, norm and clip first: all 1, the kernel
  compiled without them)."""
  c = tuple(np.float32(x) for x in c)
  if c[:3] == (1, 1, 1):
    c = (None, None, None) + c[3:]
  update(_KINDS[name], p, g, s1, s2, out, c, numba.get_num_threads())


def adam(p, g, m, v, out, *c):
  """AdamW (``c``: divisor, norm, clip c, -lr, b1, b2, eps, eps_root,
  wd, bc1, bc2, l2)."""
  run("adam", p, g, m, v, out, c)


def lion(p, g, m, out, *c):
  """Lion (``c``: divisor, norm, clip c, -lr, b1, b2, wd, down at
  zero)."""
  run("lion", p, g, m, NOTHING, out, c)


def sgd(p, g, t, out, *c):
  """SGD (``c``: divisor, norm, clip c, -lr, momentum, nesterov)."""
  run("sgd", p, g, t, NOTHING, out, c)


def adagrad(p, g, s, out, *c):
  """Adagrad (``c``: divisor, norm, clip c, -lr, eps)."""
  run("adagrad", p, g, s, NOTHING, out, c)


def torch_sgd(p, g, buf, out, *c):
  """torch's SGD (``c``: divisor, norm, clip c, -lr, l2, momentum,
  1 - dampening, first, nesterov)."""
  run("torch_sgd", p, g, buf, NOTHING, out, c)


def torch_adagrad(p, g, s, out, *c):
  """torch's Adagrad (``c``: divisor, norm, clip c, -lr, l2, eps,
  lr decay)."""
  run("torch_adagrad", p, g, s, NOTHING, out, c)


def cast(p, out):
  """The compute copy alone (after a restore, or a skipped step)."""
  run("cast", p, NOTHING, NOTHING, NOTHING, out, ())
