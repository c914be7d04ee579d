"""Causal self-attention of the reference GPT: multi-head or grouped-query
heads, rotary positions, and the implementations ``GPTConfig.attention``
names (the einsum reference, XLA's fused attention, cuDNN's flash
attention)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from zero_jax import _compat
from zero_jax.layout import MODEL
from zero_jax.layout._mesh import auto_model_size


def cudnn_supported(q: jax.Array) -> bool:
  """Whether cuDNN's flash attention takes heads like ``q`` (B, T, H, hd)."""
  hd = q.shape[-1]
  return (q.dtype in (jnp.bfloat16, jnp.float16) and hd % 8 == 0 and
          hd <= 128)


def _einsum_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """Explicit causal attention of (B, T, H, hd) heads, float32 softmax.
  Keys and values of fewer heads (grouped-query) are repeated for each
  group: query head ``n`` reads key/value head ``n // group``, as
  ``jax.nn.dot_product_attention`` pairs them."""
  group = q.shape[2] // k.shape[2]
  if group > 1:
    k, v = (jnp.repeat(a, group, axis=2) for a in (k, v))
  t, hd = q.shape[1], q.shape[-1]
  # (B, T, H, hd) -> (B, H, T, hd)
  q, k, v = (a.transpose(0, 2, 1, 3) for a in (q, k, v))
  scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(hd)
  mask = jnp.tril(jnp.ones((t, t), dtype=bool))
  # Softmax in float32 so that low-precision compute stays stable.
  scores = jnp.where(mask, scores.astype(jnp.float32), -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("bhqk,bhkd->bhqd", probs, v).transpose(0, 2, 1, 3)


def rotary(x: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding of (B, T, H, hd) heads at positions 0..T-1:
  each pair of features (i, i + hd/2) turned by ``position *
  theta**(-2i/hd)`` (the rotate-half form, as Llama), in float32."""
  t, hd = x.shape[1], x.shape[-1]
  half = hd // 2
  freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = jnp.arange(t, dtype=jnp.float32)[:, None] * freqs[None, :]
  cos = jnp.cos(angles)[None, :, None, :]
  sin = jnp.sin(angles)[None, :, None, :]
  x1 = x[..., :half].astype(jnp.float32)
  x2 = x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                         axis=-1).astype(x.dtype)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array,
            attention: str) -> jax.Array:
  """Causal attention of (B, T, H, hd) queries over keys and values of H
  or fewer heads (grouped-query), by the named implementation."""
  if attention == "einsum":
    return _einsum_attention(q, k, v)
  if attention == "fused":
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)
  cudnn = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="cudnn")
  if auto_model_size() > 1:
    # JAX's cuDNN attention cannot be partitioned over an automatic axis
    # inside the engine's shard_map (its partitioner fails on the sharding
    # it is handed, jax 0.10-0.12): the einsum, which the compiler splits
    # by heads.
    if attention == "cudnn":
      raise ValueError(
          "GPTConfig.attention='cudnn' cannot run with the heads split over "
          f"the mesh's '{MODEL}' axis (JAX's cuDNN attention is not "
          "partitioned there): use attention='auto' (the einsum under "
          "tensor parallelism) or 'einsum'")
    return _einsum_attention(q, k, v)
  if attention == "cudnn":
    if not _compat.cudnn_detected():
      raise RuntimeError(
          "GPTConfig.attention='cudnn' needs cuDNN, which this JAX does "
          "not detect (JAX's CUDA plugin is not installed): install "
          "jax[cuda12] on a Linux machine, or use attention='auto', which "
          "takes cuDNN only in programs for NVIDIA GPUs")
    return cudnn(q, k, v)
  # Without the CUDA plugin no program here is for an NVIDIA GPU, and
  # tracing the cuDNN branch below would raise (cuDNN is not detected):
  # the einsum alone.
  if not cudnn_supported(q) or not _compat.cudnn_detected():
    return _einsum_attention(q, k, v)
  # Chosen when the program is lowered: cuDNN in a program for an NVIDIA
  # GPU (a compile-only one too), the einsum in any other.
  return jax.lax.platform_dependent(q, k, v, cuda=cudnn,
                                    default=_einsum_attention)


def causal_self_attention(x: jax.Array, qkv_w: jax.Array,
                          out_w: jax.Array, out_b: jax.Array,
                          n_heads: int, attention: str = "einsum", *,
                          kv_heads: int | None = None,
                          rope_theta: float | None = None) -> jax.Array:
  """Causal self-attention of ``x`` (B, T, d) -> (B, T, d), by
  ``GPTConfig.attention``'s implementation: multi-head, or grouped-query
  with ``kv_heads`` key/value heads. ``qkv_w``'s columns are ``(kv_heads,
  n_heads / kv_heads + 2, head_dim)``: a model rank's contiguous share of
  them (its ``kv_heads / M`` groups) and of ``out_w``'s rows gives its
  partial sum. ``rope_theta``: rotary positions on queries and keys with
  this base (None: none)."""
  b, t, _ = x.shape
  kv = n_heads if kv_heads is None else kv_heads
  group = n_heads // kv
  # No QKV bias: a key bias adds the same q.b to every score of a row, which
  # softmax ignores, so its true gradient is zero and Adam-like optimizers
  # would amplify pure rounding noise into it.
  qkv = (x @ qkv_w).reshape(b, t, kv, group + 2, -1)
  if group == 1:
    q, k, v = (qkv[:, :, :, i] for i in range(3))     # each (B, T, H, hd)
  else:
    q = qkv[:, :, :, :group].reshape(b, t, n_heads, -1)
    k, v = qkv[:, :, :, group], qkv[:, :, :, group + 1]  # (B, T, kv, hd)
  if rope_theta is not None:
    q, k = rotary(q, rope_theta), rotary(k, rope_theta)
  return _attend(q, k, v, attention).reshape(b, t, -1) @ out_w + out_b
