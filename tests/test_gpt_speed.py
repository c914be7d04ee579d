"""The reference GPT's speed features: cuDNN attention where the step is
compiled for an NVIDIA GPU (CPU programs unchanged) and the chunked loss."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zero_jax as zj
from tests import _models as m
from tests._gpu import compiles_for_gpus
from zero_jax.estimate import compile_gpt
from zero_jax.memory import compiled_memory
from zero_jax.models import GPT, GPTConfig, make_loss_fn
from zero_jax.models.gpt import chunked_cross_entropy


def _forward(attention, dtype):
  model = GPT(GPTConfig(d_model=64, n_heads=4, attention=attention),
              rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  params = jax.tree.map(lambda x: x.astype(dtype), params)
  tokens = jnp.arange(32).reshape(2, 16) % 256
  return np.asarray(jax.jit(lambda p: nnx.merge(graphdef, p)(tokens))(params))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_default_attention_is_unchanged_on_cpu(dtype):
  assert GPTConfig().attention == "auto"
  np.testing.assert_array_equal(_forward("auto", dtype),
                                _forward("einsum", dtype))


@compiles_for_gpus
def test_default_gpt_calls_cudnn_attention_when_compiled_for_an_h100():
  shape = dict(layers=2, hidden=256, heads=4, vocab=512, seq_len=128,
               micro_batch=4)
  _, auto = compile_gpt("h100", 1, 3, attention="auto", **shape)
  _, einsum = compile_gpt("h100", 1, 3, attention="einsum", **shape)
  assert "__cudnn$fmha" in auto.hlo
  assert "__cudnn$fmha" not in einsum.hlo
  assert auto.memory.peak < einsum.memory.peak


def _loss_setup(chunk):
  cfg = GPTConfig(vocab_size=2048, seq_len=64, d_model=32, n_layers=1,
                  n_heads=2, loss_chunk=chunk)
  graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  tokens = np.random.default_rng(0).integers(0, 2048, (16, 65),
                                             dtype=np.int32)
  return make_loss_fn(graphdef), params, {"tokens": tokens}


def test_chunked_loss_equals_the_plain_one_and_lowers_the_peak():
  results, peaks = [], []
  for chunk in (None, 128):
    loss_fn, params, batch = _loss_setup(chunk)
    step = jax.jit(jax.value_and_grad(loss_fn))
    results.append(step(params, batch))
    peaks.append(compiled_memory(step.lower(params, batch).compile()).peak)
  (loss, grads), (chunked, chunked_grads) = results
  np.testing.assert_allclose(chunked, loss, rtol=1e-6)
  for g, c in zip(jax.tree.leaves(grads), jax.tree.leaves(chunked_grads)):
    np.testing.assert_allclose(c, g, rtol=1e-5, atol=1e-7)
  # The whole float32 logits and their gradient: 2 x 1024 x 2048 x 4 bytes.
  assert peaks[1] < peaks[0] - 8 * 2**20, peaks
  with pytest.raises(ValueError, match="loss_chunk 100 must divide the 1024"):
    chunked_cross_entropy(jnp.ones((16, 64, 8)), jnp.ones((8, 4)),
                          jnp.zeros((16, 64), jnp.int32), 100)


def test_chunked_loss_trains_exactly_at_stage_3():
  loss_fn, params, batch = _loss_setup(64)
  tx = optax.adamw(1e-3)
  # (Per device 2 sequences x 64 tokens: the chunk divides them.)
  ref_losses, _ = m.train_reference(loss_fn, tx, params, [batch] * 2)
  engine = zj.Engine(loss_fn, tx, zj.ZeroConfig(stage=3),
                     zj.make_mesh(num_devices=8))
  state = engine.init(params)
  losses = []
  for _ in range(2):
    state, metrics = engine.step(state, batch)
    losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
