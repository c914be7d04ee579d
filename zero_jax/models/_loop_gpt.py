"""GPTs whose blocks are called in a Python loop, as Flax's examples write
them: NNX blocks in a list, Linen blocks made in a loop inside
``nn.compact``; with ``scanned=True`` the same blocks stacked and run through
``zero_jax.scan_nnx`` / ``zero_jax.scan_linen``. What ``zero_jax.layers``
runs one block at a time on (``experiments/block_memory.py``,
``tests/layers/test_blocks.py``)."""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from zero_jax.layers import scan_linen, scan_nnx


def _attention(qkv: jax.Array, heads: int) -> jax.Array:
  b, t, d3 = qkv.shape
  q, k, v = jnp.split(qkv, 3, axis=-1)
  split = lambda a: a.reshape(b, t, heads, d3 // 3 // heads)
  out = jax.nn.dot_product_attention(split(q), split(k), split(v),
                                     is_causal=True)
  return out.reshape(b, t, d3 // 3)


class Block(nnx.Module):
  """Pre-LN transformer block (NNX)."""

  def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs):
    self.heads = heads
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    # (No bias: the key's has a zero gradient, which Adam turns into noise.)
    self.qkv = nnx.Linear(d, 3 * d, use_bias=False, rngs=rngs)
    self.proj = nnx.Linear(d, d, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.up = nnx.Linear(d, 4 * d, rngs=rngs)
    self.down = nnx.Linear(4 * d, d, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.proj(_attention(self.qkv(self.ln1(x)), self.heads))
    return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class NNXGPT(nnx.Module):
  """Embedding, ``layers`` blocks, final norm and head (NNX)."""

  def __init__(self, vocab: int, d: int, heads: int, layers: int, *,
               rngs: nnx.Rngs, scanned: bool = False):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.scanned = scanned
    if scanned:
      self.blocks = nnx.vmap(lambda r: Block(d, heads, rngs=r))(
          rngs.split(layers))
    else:
      self.blocks = nnx.List([Block(d, heads, rngs=rngs)
                              for _ in range(layers)])
    self.ln = nnx.LayerNorm(d, rngs=rngs)
    self.head = nnx.Linear(d, vocab, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    if self.scanned:
      x = scan_nnx(self.blocks, x)
    else:
      for block in self.blocks:
        x = block(x)
    return self.head(self.ln(x))


class LinenBlock(nn.Module):
  """Pre-LN transformer block (Linen)."""
  heads: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    d = x.shape[-1]
    qkv = nn.Dense(3 * d, use_bias=False)(nn.LayerNorm()(x))
    x = x + nn.Dense(d)(_attention(qkv, self.heads))
    return x + nn.Dense(d)(jax.nn.gelu(nn.Dense(4 * d)(nn.LayerNorm()(x))))


class _ScanBlock(nn.Module):
  heads: int

  @nn.compact
  def __call__(self, x, _):
    return LinenBlock(self.heads)(x), None


class LinenGPT(nn.Module):
  """Embedding, ``layers`` blocks, final norm and head (Linen)."""
  vocab: int
  d: int
  heads: int
  layers: int
  scanned: bool = False

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = nn.Embed(self.vocab, self.d)(tokens)
    if self.scanned:
      x, _ = scan_linen(_ScanBlock, variable_axes={"params": 0},
                        split_rngs={"params": True}, length=self.layers)(
                            self.heads, name="blocks")(x, None)
    else:
      for _ in range(self.layers):
        x = LinenBlock(self.heads)(x)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def _xent(logits: jax.Array, batch: Any) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), batch["y"]).mean()


def loop_gpt(framework: str, *, vocab: int, d: int, heads: int, layers: int,
             scanned: bool = False) -> tuple[Callable[..., Any], Any]:
  """``(loss_fn, params)`` of the NNX (``"nnx"``) or Linen (``"linen"``)
  GPT; ``loss_fn(params, {"x": tokens, "y": targets})`` is the mean
  next-token cross-entropy."""
  if framework == "nnx":
    model = NNXGPT(vocab, d, heads, layers, rngs=nnx.Rngs(0),
                   scanned=scanned)
    graphdef, params = nnx.split(model, nnx.Param)
    return (lambda p, b: _xent(nnx.merge(graphdef, p)(b["x"]), b)), params
  if framework != "linen":
    raise ValueError(f"framework must be 'nnx' or 'linen', got {framework!r}")
  linen = LinenGPT(vocab, d, heads, layers, scanned)
  params = linen.init(jax.random.PRNGKey(0),
                      jnp.zeros((2, 8), jnp.int32))["params"]
  return (lambda p, b: _xent(linen.apply({"params": p}, b["x"]), b)), params
