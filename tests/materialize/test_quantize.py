"""ZeRO++'s quantized collectives (``Quantize``): int8 blocks with
float32 scales, against plain arrays, with the error each adds bounded.

And the exact path they sit beside: 16-bit gradients summed in float32
cross as they are, by an all-to-all, and give a float32 reduce-scatter's
sums.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import zero_jax as zj
from zero_jax import layout, materialize
from zero_jax.layout._placement import Quantize
from zero_jax.materialize._collectives import (dequantize_blocks,
                                               quantize_blocks, reduce_leaf)

N = 8
BLOCK = 256
# (Jitted: one compile per shape instead of one per operation.)
_quantize = jax.jit(quantize_blocks, static_argnums=1)
_dequantize = jax.jit(dequantize_blocks, static_argnums=2)


def _blocks(x, block):
  """``x`` (numpy) as ``(rows..., blocks, b)`` as ``quantize_blocks`` cuts
  it."""
  k = x.shape[-1]
  b = block if k % block == 0 else k
  return x.reshape(x.shape[:-1] + (k // b, b))


@pytest.mark.parametrize("shape", [(3, 512), (4, 100), (1024,)])
def test_blocks_round_trip_within_half_a_scale(shape):
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), shape)) * 3
  q, scale = _quantize(jnp.asarray(x), BLOCK)
  assert q.dtype == jnp.int8 and q.shape == shape
  assert scale.dtype == jnp.float32
  # A block of 256 where it divides the last dimension, else the whole
  # dimension (100 elements: one block per row).
  assert scale.shape == shape[:-1] + (max(shape[-1] // BLOCK, 1),)
  back = np.asarray(_dequantize(q, scale, jnp.float32))
  err = np.abs(_blocks(back - x, BLOCK))
  bound = np.asarray(scale)[..., None] / 2
  assert np.all(err <= bound * (1 + 1e-6))
  # The scale is each block's max |x| / 127, so its largest element is
  # exact up to float rounding.
  np.testing.assert_allclose(np.asarray(scale),
                             np.abs(_blocks(x, BLOCK)).max(-1) / 127,
                             rtol=1e-6)


def test_zero_blocks_stay_zero_and_non_finite_blocks_stay_non_finite():
  x = np.zeros((2, 512), np.float32)
  x[1, 300] = np.inf
  q, scale = _quantize(jnp.asarray(x), BLOCK)
  back = np.asarray(_dequantize(q, scale, jnp.float32))
  np.testing.assert_array_equal(back[0], 0.0)
  np.testing.assert_array_equal(back[1, :256], 0.0)
  # The step's overflow check must still see the inf.
  assert not np.all(np.isfinite(back[1, 256:]))


def _setup(shape):
  mesh = zj.make_mesh(num_devices=N)
  lp = layout.plan_leaf(shape, N, 3, 0)
  x = jax.random.normal(jax.random.PRNGKey(1), shape)
  weights = jnp.arange(1.0, N + 1.0)
  return mesh, lp, x, weights


@pytest.mark.parametrize("shape", [(16, 2048), (2048, 24), (2, 8, 512)])
def test_quantized_gather_is_each_shard_dequantized(shape):
  # qwZ: the whole array is every shard's int8 blocks, dequantized; the
  # gradient still comes back to the shard, reduce-scattered.
  mesh, lp, x, weights = _setup(shape)
  how = materialize.Materializer(layout.Materialize.GATHER,
                                 quantize=Quantize(weights=True))

  def local(shard, w):
    def loss(s):
      full = how(lp, s, None)
      return w[0] * jnp.sum(jnp.sin(full)), full
    g, full = jax.grad(loss, has_aux=True)(shard)
    return full, g

  full, grad = jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(lp.spec, P("data")),
      out_specs=(P(), lp.spec), check_vma=False))(x, weights)
  shards = np.split(np.asarray(x), N, axis=lp.dim)
  expect = np.concatenate(
      [np.asarray(_dequantize(
          *_quantize(jnp.asarray(s), BLOCK), jnp.float32))
       for s in shards], axis=lp.dim)
  np.testing.assert_array_equal(np.asarray(full), expect)
  assert np.max(np.abs(np.asarray(full) - np.asarray(x))) <= (
      np.max(np.abs(np.asarray(x))) / 254 * (1 + 1e-6))
  np.testing.assert_allclose(grad, jnp.cos(full) * jnp.sum(weights),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(16, 2048), (2048, 24)])
def test_quantized_reduce_scatter_error_is_bounded(shape):
  # qgZ: device d sends w_d * x as int8 blocks; each block it sends is off
  # by at most half its scale, w_d * max|x's block| / 127.
  mesh, lp, x, weights = _setup(shape)
  quantize = Quantize(gradients=True)

  def local(w):
    return reduce_leaf(lp, w[0] * x, quantize=quantize)

  summed = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"),),
                                 out_specs=lp.spec, check_vma=False))(weights)
  exact = np.asarray(x, np.float64) * float(jnp.sum(weights))
  err = np.abs(np.asarray(summed, np.float64) - exact)
  # A block lies within one row of the last dimension: bound each element
  # by its row's largest |x|.
  rows = np.abs(np.asarray(x)).max(axis=-1, keepdims=True)
  assert np.all(err <= rows * float(jnp.sum(weights)) / 254 * (1 + 1e-5)
                + 1e-6)
  assert np.max(err) > 0  # it is quantized


def test_16bit_gradients_summed_in_float32_match_a_float32_reduce_scatter():
  # The default with a 16-bit compute dtype: an all-to-all of the bf16
  # gradient, summed in float32 on the shard: the float32 sums of the same
  # bf16 values, not their bf16 sums.
  mesh, lp, x, weights = _setup((16, 2048))
  grads = (x[None] * weights[:, None, None] * 1.001).astype(jnp.bfloat16)

  def local(g):
    return (reduce_leaf(lp, g[0], reduce_dtype=jnp.float32,
                                    out_dtype=jnp.float32),
            reduce_leaf(lp, g[0], reduce_dtype=jnp.bfloat16,
                                    out_dtype=jnp.float32))

  wide, narrow = jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(P("data"),), out_specs=(lp.spec, lp.spec),
      check_vma=False))(grads)
  exact = np.asarray(grads, np.float64).sum(0)
  np.testing.assert_allclose(np.asarray(wide), exact, rtol=2e-7, atol=1e-6)
  # (bf16 sums are off by far more: what the float32 path avoids.)
  assert np.max(np.abs(np.asarray(narrow) - exact)) > 100 * np.max(
      np.abs(np.asarray(wide) - exact))
  text = jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(P("data"),), out_specs=(lp.spec, lp.spec),
      check_vma=False)).lower(grads).as_text(dialect="hlo")
  assert "all-to-all" in text and "reduce-scatter" in text
