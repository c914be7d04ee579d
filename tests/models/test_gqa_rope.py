"""The reference GPT's Llama attention: grouped-query heads and rotary
positions, exact against their definitions and under ZeRO."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zero_jax as zj
from tests import _models as m
from zero_jax.models import GPT, GPTConfig, make_loss_fn
from zero_jax.models._attention import causal_self_attention, rotary

_SMALL = dict(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=4)


def _split(cfg: GPTConfig):
  return nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)


def test_one_kv_head_per_query_head_is_the_model_as_it_was():
  _, before = _split(GPTConfig(**_SMALL))
  graphdef, after = _split(GPTConfig(**_SMALL, n_kv_heads=4))
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)
  tokens = jnp.arange(2 * 16).reshape(2, 16) % 64
  np.testing.assert_array_equal(nnx.merge(graphdef, before)(tokens),
                                nnx.merge(graphdef, after)(tokens))


@pytest.mark.parametrize("attention", ["einsum", "fused"])
def test_grouped_query_attention_is_multi_head_with_shared_keys(attention):
  # The grouped weight against a multi-head one whose key and value
  # columns repeat each group's: the same attention.
  b, t, d, heads, kv = 2, 8, 32, 4, 2
  hd, group = d // heads, heads // kv
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  w = rng.normal(size=(d, kv, group + 2, hd)).astype(np.float32) * 0.2
  out_w = jnp.asarray(rng.normal(size=(d, d)), jnp.float32) * 0.2
  out_b = jnp.zeros((d,), jnp.float32)
  mha = np.zeros((d, heads, 3, hd), np.float32)
  for n in range(heads):
    j, i = divmod(n, group)  # query head n = j * group + i reads kv head j
    mha[:, n, 0] = w[:, j, i]
    mha[:, n, 1] = w[:, j, group]
    mha[:, n, 2] = w[:, j, group + 1]
  for theta in (None, 10000.0):
    got = causal_self_attention(x, jnp.asarray(w.reshape(d, -1)), out_w,
                                out_b, heads, attention, kv_heads=kv,
                                rope_theta=theta)
    want = causal_self_attention(x, jnp.asarray(mha.reshape(d, -1)), out_w,
                                 out_b, heads, "einsum", rope_theta=theta)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_rotary_positions_make_scores_depend_on_the_distance_only():
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)
  t = 12
  qs, ks = (rotary(jnp.broadcast_to(a, (1, t, 1, 16)), 500000.0)
            for a in (q, k))
  np.testing.assert_allclose(qs[0, 0], q[0, 0], rtol=1e-6)  # position 0
  scores = jnp.einsum("qd,kd->qk", qs[0, :, 0], ks[0, :, 0])
  for shift in (1, 3):
    # Score(m, n) = Score(m + s, n + s).
    np.testing.assert_allclose(scores[:-shift, :-shift],
                               scores[shift:, shift:], rtol=2e-4, atol=2e-5)
  assert not np.allclose(scores[0, 1], scores[0, 2])


def test_a_rope_model_has_no_learned_positions():
  graphdef, params = _split(GPTConfig(**_SMALL, rope=True))
  model = nnx.merge(graphdef, params)
  assert model.pos_emb is None
  assert params["blocks"]["attn_qkv"].shape == (2, 32, 96)
  grouped = _split(GPTConfig(**_SMALL, rope=True, n_kv_heads=1))[1]
  # (4 query heads + 2 x 1 key/value head) x 8 features.
  assert grouped["blocks"]["attn_qkv"].shape == (2, 32, 48)


def test_bad_head_counts_name_the_fix():
  with pytest.raises(ValueError, match=r"n_kv_heads \(3\) must divide "
                     r"n_heads \(4\).*n_kv_heads=2"):
    GPTConfig(**_SMALL, n_kv_heads=3)
  with pytest.raises(ValueError, match="head size .* is odd"):
    GPTConfig(vocab_size=64, d_model=12, n_heads=4, rope=True)


@functools.lru_cache(maxsize=None)
def _reference():
  cfg = GPTConfig(**_SMALL, n_kv_heads=2, rope=True)
  graphdef, params = _split(cfg)
  rng = np.random.default_rng(0)
  batches = [{"tokens": rng.integers(0, 64, size=(16, 17), dtype=np.int32)}
             for _ in range(4)]
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3))
  return make_loss_fn(graphdef), params, batches, tx, m.train_reference(
      make_loss_fn(graphdef), tx, params, batches)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_grouped_rotary_gpt_trains_as_one_device(stage):
  loss_fn, params, batches, tx, (ref_losses, ref_params) = _reference()
  engine = zj.Engine(loss_fn, tx, zj.ZeroConfig(stage=stage,
                                                min_shard_elements=0),
                     zj.make_mesh())
  losses, out, _ = m.train_engine(engine, params, batches)
  m.assert_matches(losses, out, ref_losses, ref_params)


def test_the_llama3_8b_shape_has_its_parameters():
  cfg = zj.models.llama3_8b()
  shapes = nnx.state(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))),
                     nnx.Param)
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
  assert abs(n / 8.03e9 - 1) < 0.005, n
  assert (cfg.kv_heads, cfg.d_model // cfg.n_heads, cfg.rope) == (8, 128,
                                                                   True)
