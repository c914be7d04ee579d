"""scan_layers and remat policies."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from tests import _models as m
from zero_jax.memory import compiled_memory


def test_scan_layers_outside_an_engine_is_a_scan():
  xs = {"w": jax.random.normal(jax.random.PRNGKey(0), (3, 4, 4))}
  f = lambda h, p: (jnp.tanh(h @ p["w"]), jnp.sum(h))
  h0 = jnp.ones((2, 4))
  for remat in zj.REMAT_POLICIES:
    got = zj.scan_layers(f, h0, xs, remat=remat)
    want = jax.lax.scan(f, h0, xs)
    jax.tree.map(np.testing.assert_allclose, got, want)
  with pytest.raises(ValueError, match="unknown remat policy"):
    zj.scan_layers(f, h0, xs, remat="everything")
  with pytest.raises(ValueError, match="remat must be one of"):
    zj.ZeroConfig(remat="everything")


def _temp(remat):
  loss_fn, params, batches = m.gpt_setup(d_model=128, n_layers=4, steps=1)
  engine = zj.Engine(loss_fn, optax.sgd(1e-2),
                     zj.ZeroConfig(stage=3, remat=remat),
                     zj.make_mesh(num_devices=8))
  state = engine.init(params)
  return compiled_memory(engine.step.lower(state, batches[0]).compile()).temp


def test_default_remat_does_not_keep_gathered_layers():
  # "none" saves every layer's gathered parameters for backward; "full"
  # re-gathers them, so at least three of the four layers' full fp32
  # parameters (4 layers x 12 d^2 x 4 bytes) are not held.
  layer_bytes = 12 * 128 * 128 * 4
  assert _temp("none") - _temp("full") >= 3 * layer_bytes
