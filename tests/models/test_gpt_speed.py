"""The reference GPT's speed features: cuDNN attention where the step is
compiled for an NVIDIA GPU (CPU programs unchanged) and the chunked loss.

(That the default GPT's train step calls cuDNN's attention when compiled
for an H100, and peaks below the einsum's, is checked in
tests/train/test_auto_remat.py, on the step whose remat candidates it
compiles.)"""

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zero_jax as zj
from tests import _models as m
from tests._gpu import AVAILABLE, compiles_for_gpus
from zero_jax import _compat
from zero_jax import analysis
from zero_jax.analysis import compiled_memory
from zero_jax.models import GPT, GPTConfig, make_loss_fn
from zero_jax.models import chunked_cross_entropy


def _forward(attention, dtype):
  model = GPT(GPTConfig(d_model=64, n_heads=4, attention=attention),
              rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  params = jax.tree.map(lambda x: x.astype(dtype), params)
  tokens = jnp.arange(32).reshape(2, 16) % 256
  return np.asarray(jax.jit(lambda p: nnx.merge(graphdef, p)(tokens))(params))


@functools.cache
def _einsum(dtype):
  """``_forward("einsum", dtype)``, computed once: the reference of the
  tests below (no test changes what einsum attention does)."""
  return _forward("einsum", dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_default_attention_is_unchanged_on_cpu(dtype):
  assert GPTConfig().attention == "auto"
  np.testing.assert_array_equal(_forward("auto", dtype), _einsum(dtype))


def _no_cudnn(monkeypatch):
  """As on a plain `pip install jax` (no CUDA plugin): cuDNN is not
  detected, and tracing cuDNN's attention raises as JAX does there."""
  real = jax.nn.dot_product_attention

  def attention(*args, implementation=None, **kwargs):
    if implementation == "cudnn":
      raise RuntimeError("cuDNN is not detected.")
    return real(*args, implementation=implementation, **kwargs)

  monkeypatch.setattr(jax.nn, "dot_product_attention", attention)
  monkeypatch.setattr(_compat, "cudnn_detected", lambda: False)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_without_cudnn_auto_attention_never_traces_cudnn(monkeypatch, dtype):
  einsum = _einsum(dtype)
  _no_cudnn(monkeypatch)
  np.testing.assert_array_equal(_forward("auto", dtype), einsum)


def test_cudnn_attention_without_cudnn_names_the_fix(monkeypatch):
  _no_cudnn(monkeypatch)
  with pytest.raises(RuntimeError, match="attention='cudnn' needs cuDNN.*"
                     "jax\\[cuda12\\].*attention='auto'"):
    _forward("cudnn", jnp.bfloat16)


def test_cudnn_detected_reads_jaxs_cuda_versions(monkeypatch):
  # True exactly where the CUDA plugin is installed; read from JAX's
  # cuda_versions, not from the fallback (the plugin's module), which is
  # hidden here.
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  assert _compat.cudnn_detected() is AVAILABLE


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


def _head_matmuls(jaxpr, vocab):
  """dot_generals with a vocabulary-sized operand or result, nested
  jaxprs (scan bodies, custom_vjp rules) included."""
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general" and any(
        vocab in getattr(v.aval, "shape", ())
        for v in (*eqn.invars, *eqn.outvars)):
      n += 1
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          n += _head_matmuls(sub, vocab)
  return n


def test_chunked_loss_does_not_run_the_head_again():
  # The whole loss: the head's matmul forward and its two transposes. The
  # chunked one fuses the gradients into forward: the same three (a remat'd
  # chunk would run the forward matmul again in backward: four).
  counts = []
  for chunk in (None, 128):
    loss_fn, params, batch = _loss_setup(chunk)
    counts.append(_head_matmuls(jax.make_jaxpr(jax.value_and_grad(
        loss_fn))(params, batch).jaxpr, 2048))
  assert counts == [3, 3]
  # Evaluated without gradients: the forward matmul alone.
  assert _head_matmuls(jax.make_jaxpr(loss_fn)(params, batch).jaxpr,
                       2048) == 1


def test_chunked_loss_gradients_in_float16_with_a_loss_scale():
  # float16 compute, the loss scaled as the engine scales it: the chunked
  # loss's gradients are the whole loss's, to float16 rounding (the mean's
  # 1/n taken before the matmuls would underflow them).
  grads = []
  for chunk in (None, 256):
    loss_fn, params, _ = _loss_setup(chunk)
    tokens = np.random.default_rng(1).integers(0, 2048, (64, 65),
                                               dtype=np.int32)
    half = jax.tree.map(lambda x: x.astype(jnp.float16), params)
    grads.append(jax.jit(jax.grad(
        lambda p: loss_fn(p, {"tokens": tokens}) * 1024.0))(half))
  for g, c in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
    assert c.dtype == jnp.float16
    g, c = np.asarray(g, np.float32), np.asarray(c, np.float32)
    assert np.abs(c - g).max() <= 2e-3 * np.abs(g).max()


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


@compiles_for_gpus
def test_gpt_config_remat_sets_the_policy_without_an_engine():
  # Plain jax.jit at a policy an engine would use (the GPU benchmark's
  # baseline): cuDNN's forward runs once with the attention kept, twice
  # with full remat (the default outside an engine).
  device = analysis.gpu_devices("h100", 1)[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  counts = {}
  for remat in (None, "dots_attention_saveable"):
    cfg = GPTConfig(vocab_size=512, seq_len=256, d_model=128, n_layers=2,
                    n_heads=4, remat=remat)
    graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16,
                                       sharding=sharding), params)
    batch = {"tokens": jax.ShapeDtypeStruct((4, 257), jnp.int32,
                                            sharding=sharding)}
    hlo = jax.jit(jax.grad(make_loss_fn(graphdef))).lower(
        shapes, batch).compile().as_text()
    counts[remat] = hlo.count('custom_call_target="__cudnn$fmhaSoftmax"')
  assert counts == {None: 2, "dots_attention_saveable": 1}
  with pytest.raises(ValueError, match="auto is chosen by an engine"):
    GPTConfig(remat="auto")
  with pytest.raises(ValueError, match="GPTConfig.remat must be None or"):
    GPTConfig(remat="most")
