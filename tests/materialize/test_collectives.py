"""The per-leaf collectives and the Materializer, against plain arrays.

Inside ``shard_map`` over ``data`` (8 devices), each way of making a
sharded parameter whole gives the global array, and the gradient that
comes back to the shard is that device's slice of the gradient summed over
devices: the reduce-scatter ZeRO relies on.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import zero_jax as zj
from zero_jax import layout, materialize
from zero_jax.materialize._collectives import (cast, gather_replicated,
                                               reduce_leaf)

N = 8


def _setup(shape=(16, 24), dim=1):
  mesh = zj.make_mesh(num_devices=N)
  lp = layout.plan_leaf(shape, N, 3, 0)
  assert lp.dim == dim
  x = jax.random.normal(jax.random.PRNGKey(0), shape)
  # Each device's weight in the loss differs, so the summed gradient is
  # not N times one device's.
  weights = jnp.arange(1.0, N + 1.0)
  return mesh, lp, x, weights


def _reference_grad(x, weights):
  """d/dx of sum over devices d of w_d * sum(sin(x)): cos(x) * sum(w)."""
  return jnp.cos(x) * jnp.sum(weights)


@pytest.mark.parametrize("kind", [layout.Materialize.GATHER,
                                  layout.Materialize.SCATTER,
                                  layout.Materialize.GATHER_FROM])
def test_every_materializer_gives_the_whole_array_and_the_scattered_grad(
    kind):
  mesh, lp, x, weights = _setup()
  how = materialize.Materializer(kind)
  spec = lp.spec

  def local(shard, replicated, w):
    # GATHER differentiates the shard itself; SCATTER reads the replicated
    # copy, GATHER_FROM another shard: both send the gradient to the shard.
    source = {layout.Materialize.GATHER: None,
              layout.Materialize.SCATTER: jax.lax.pcast(
                  replicated, "data", to="varying"),
              layout.Materialize.GATHER_FROM: shard}[kind]
    stand_in = (shard if kind is layout.Materialize.GATHER else
                jnp.zeros_like(shard))

    def loss(s):
      full = how(lp, s, source)
      return w[0] * jnp.sum(jnp.sin(full)), full

    g, full = jax.grad(loss, has_aux=True)(stand_in)
    return full, g

  fn = jax.shard_map(local, mesh=mesh, in_specs=(spec, P(), P("data")),
                     out_specs=(P(), spec), check_vma=False)
  full, grad = jax.jit(fn)(x, x, weights)
  np.testing.assert_allclose(full, x, rtol=1e-6)
  np.testing.assert_allclose(grad, _reference_grad(x, weights), rtol=1e-5)


def test_reduce_leaf_sums_over_devices_into_each_layout():
  mesh, lp, x, weights = _setup()
  replicated = layout.plan_leaf((3,), N, 0, 0)  # stage 0: replicated

  def local(w):
    g = w[0] * x
    return (reduce_leaf(lp, g),
            reduce_leaf(replicated, w[0] * jnp.ones(3)))

  sharded, whole = jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(P("data"),), out_specs=(lp.spec, P()),
      check_vma=False))(weights)
  np.testing.assert_allclose(sharded, x * jnp.sum(weights), rtol=1e-6)
  np.testing.assert_allclose(whole, jnp.full(3, jnp.sum(weights)),
                             rtol=1e-6)


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_gather_replicated_makes_the_replicated_copy_in_its_dtype(dtype):
  mesh, _, x, _ = _setup()
  tree = {"w": x, "b": jnp.arange(3.0)}
  plan = layout.Plan(tree, mesh, 3, min_shard_elements=8)
  sharded = jax.device_put(tree, plan.shardings)
  out = jax.jit(functools.partial(gather_replicated, plan,
                                  dtype=dtype))(sharded)
  for name in tree:
    assert out[name].dtype == (dtype or jnp.float32)
    assert out[name].sharding.is_equivalent_to(
        NamedSharding(mesh, P()), out[name].ndim)
    np.testing.assert_allclose(np.asarray(out[name], np.float32),
                               np.asarray(jnp.asarray(tree[name], dtype
                                                      or jnp.float32),
                                          np.float32))


def test_cast_keeps_the_dtype_given_none():
  x = jnp.ones(3)
  assert cast(x, None) is x
  assert cast(x, jnp.bfloat16).dtype == jnp.bfloat16
