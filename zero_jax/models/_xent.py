"""Cross-entropy of a head's logits taken a chunk of tokens at a time, so
the float32 logits and their gradient are never whole (the GPT's
``GPTConfig.loss_chunk``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from zero_jax._compat import varying_axes


def chunked_cross_entropy(h: jax.Array, head: jax.Array, labels: jax.Array,
                          chunk: int) -> jax.Array:
  """The mean cross-entropy of ``(h @ head)`` against ``labels``, ``chunk``
  tokens at a time.

  The same value as computing the float32 logits whole, but they (and their
  gradient) exist one chunk at a time. At the 1.3B GPT's batch 16 x 1024
  and vocabulary 50304 the whole logits are 3.3 GB. Differentiated, it is a
  fused cross-entropy: forward takes each chunk's loss and its gradients
  with respect to ``h`` and ``head`` at once, and backward only scales
  them, so the head's matmul is not run again (which remat of the chunks
  would do: 2.6% of the 1.3B GPT's step FLOPs, 10% of the 125M's). Not
  differentiated (evaluation), it takes the loss alone.

  Args:
    h: hidden states (..., d).
    head: the output projection (d, vocab).
    labels: int token ids, ``h``'s shape without ``d``.
    chunk: tokens per chunk; must divide the number of tokens.

  Raises:
    ValueError: ``chunk`` does not divide the number of tokens.
  """
  d = h.shape[-1]
  h, labels = h.reshape(-1, d), labels.reshape(-1)
  n = h.shape[0]
  if n % chunk:
    raise ValueError(f"loss_chunk {chunk} must divide the {n} tokens of "
                     f"the step's batch on each device; e.g. "
                     f"{math.gcd(n, chunk)}")
  # Inside shard_map: the three typed alike (varying over the same mesh
  # axes), so that each cotangent is typed as its primal.
  axes = (varying_axes(h) | varying_axes(head)) | varying_axes(labels)
  h, head, labels = (_vary(x, axes) for x in (h, head, labels))
  return _fused_cross_entropy(h.reshape(n // chunk, chunk, d), head,
                              labels.reshape(n // chunk, chunk))


def _vary(x: jax.Array, axes: frozenset[str]) -> jax.Array:
  missing = tuple(sorted(axes - varying_axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def _chunk_logits(h_c: jax.Array, head: jax.Array) -> jax.Array:
  return (h_c @ head).astype(jnp.float32)


@jax.custom_vjp
def _fused_cross_entropy(h: jax.Array, head: jax.Array,
                         labels: jax.Array) -> jax.Array:
  """Mean cross-entropy of chunked ``h`` (chunks, chunk, d)."""
  # (The loss alone, for evaluation: per-chunk sums, no carry.)
  sums = jax.lax.map(
      lambda xs: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(
          _chunk_logits(xs[0], head), xs[1])), (h, labels))
  return jnp.sum(sums) / (h.shape[0] * h.shape[1])


def _fused_forward(h, head, labels):
  axes = varying_axes(h)

  def body(dhead, xs):
    h_c, l_c = xs
    logits = _chunk_logits(h_c, head)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    loss = jnp.sum(lse[:, 0] - jnp.take_along_axis(
        logits, l_c[:, None], axis=-1)[:, 0])
    # d(sum of losses)/d logits = softmax - one_hot, in the compute dtype as
    # autodiff would give it. The mean's 1/n and the loss scale come in
    # backward: taken here, 1/n would underflow float16 (and the loss
    # scale is there to prevent that).
    dlogits = (jnp.exp(logits - lse) - jax.nn.one_hot(
        l_c, logits.shape[-1], dtype=jnp.float32)).astype(h.dtype)
    dh_c = dlogits @ head.T
    # (Summed over every token: float32, or float16 could overflow.)
    dhead = dhead + jnp.dot(h_c.T, dlogits,
                            preferred_element_type=jnp.float32)
    return dhead, (loss, dh_c)

  zero = _vary(jnp.zeros(head.shape, jnp.float32), axes)
  dhead, (sums, dh) = jax.lax.scan(body, zero, (h, labels))
  # (A zero-size array carries head's dtype to backward.)
  return (jnp.sum(sums) / (h.shape[0] * h.shape[1]),
          (dh, dhead, jnp.zeros((0,), head.dtype)))


def _fused_backward(residuals, g):
  dh, dhead, head_like = residuals
  scale = g.astype(jnp.float32) / (dh.shape[0] * dh.shape[1])
  return ((dh.astype(jnp.float32) * scale).astype(dh.dtype),
          (dhead * scale).astype(head_like.dtype), None)


_fused_cross_entropy.defvjp(_fused_forward, _fused_backward)
