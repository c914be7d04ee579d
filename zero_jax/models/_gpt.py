"""A small GPT-style decoder in Flax NNX, for demos and tests of the engine.

In the spirit of nanoGPT: byte-level tokens, learned positions, pre-LN blocks
with causal self-attention and a GELU MLP, an untied output head. Optionally
Llama's attention: grouped-query heads (``n_kv_heads``) and rotary positions
(``rope``) in place of the learned ones.

The transformer blocks are *stacked*: each block parameter is a single
``nnx.Param`` whose leading dimension is the layer, and the blocks run as one
``jax.lax.scan`` over those stacks. That keeps compile time independent of
depth and gives ZeRO few, large leaves to shard (the planner keeps the layer
axis whole, so the scan slices one layer without touching the others).

Tensor parallelism, Megatron style: each parameter's Flax ``out_sharding``
metadata (``nnx.get_partition_spec``) splits it over the mesh axis
``"model"``: QKV and MLP-in column-parallel, attention-out and MLP-out
row-parallel, embedding and head by vocabulary; the layer axis, norms,
position embedding and row-parallel biases whole. QKV's columns are packed
by key/value head, ``(n_kv_heads, group + 2, head_dim)`` (each KV head's
``group = n_heads / n_kv_heads`` query heads, then its key and its value;
``(n_heads, 3, head_dim)`` without grouping), so that M ranks (M dividing
``n_kv_heads``) each hold whole groups: attention needs no resharding. Under
``jax.set_mesh`` of a mesh with a ``model`` axis the parameters are made so
split; elsewhere the metadata is only carried.

Example::

  model = GPT(GPTConfig(), rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  loss_fn = make_loss_fn(graphdef)
  loss = loss_fn(params, {"tokens": tokens})  # tokens: (B, seq_len + 1)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from zero_jax.config import REMAT_POLICIES
from zero_jax.layers import checkpoint_name, scan_layers
from zero_jax.layout import MODEL
from zero_jax.models._attention import causal_self_attention
from zero_jax.models._xent import chunked_cross_entropy

# Names of the stacked per-layer parameters, in the order the block uses them.
BLOCK_PARAMS = ("ln1_scale", "ln1_bias", "attn_qkv", "attn_out",
                "attn_out_bias", "ln2_scale", "ln2_bias", "mlp_in",
                "mlp_in_bias", "mlp_out", "mlp_out_bias")

_LN_EPS = 1e-5
ATTENTIONS = ("auto", "einsum", "fused", "cudnn")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Shape and regularisation of a ``GPT``.

  Attributes:
    vocab_size: number of token ids (256: one per byte).
    seq_len: longest input the position embedding covers.
    d_model: width of the residual stream.
    n_layers: number of transformer blocks.
    n_heads: attention heads; must divide ``d_model``.
    d_ff: hidden width of the MLP; None means ``4 * d_model``.
    dropout: dropout rate on the embeddings and on each residual branch; it is
      applied only when a PRNG key is passed to the model.
    attention: ``"auto"`` (the default: cuDNN's flash attention where the
      step is compiled for an NVIDIA GPU and cuDNN takes the shape, bf16 or
      fp16 heads of at most 128 features in multiples of 8; ``"einsum"``
      everywhere else, so CPU programs are unchanged; without JAX's CUDA
      plugin, or with the heads split over a ``model`` axis, the einsum is
      all that is traced), ``"einsum"`` (explicit scores and float32
      softmax, the reference), ``"fused"`` (``jax.nn.dot_product_attention``,
      XLA's choice of implementation) or ``"cudnn"`` (cuDNN's always: GPU
      only).
    loss_chunk: ``make_loss_fn``'s loss takes the head and the
      cross-entropy this many tokens at a time (``chunked_cross_entropy``),
      so the float32 logits and their gradient are never whole; None: all
      at once. It must divide the tokens per device-step (batch x seq_len).
    remat: the layer scan's remat policy (a key of
      ``zero_jax.REMAT_POLICIES``); None (the default): the engine's
      ``ZeroConfig.remat``, ``"full"`` outside an engine. Set it to train
      without an engine (plain ``jax.jit``) as an engine would.
    n_kv_heads: key/value heads of grouped-query attention (Llama 3's 8 of
      32); each serves ``n_heads / n_kv_heads`` query heads. None (the
      default): as many as ``n_heads`` (multi-head attention, the
      parameters of the model without this field).
    rope: rotary position embeddings on queries and keys (RoFormer, as
      Llama), with no learned position embedding; False (the default):
      learned positions added to the token embedding. Needs an even head
      size.
    rope_theta: the rotary base (Llama 3: 500000).
  """

  vocab_size: int = 256
  seq_len: int = 64
  d_model: int = 64
  n_layers: int = 2
  n_heads: int = 4
  d_ff: int | None = None
  dropout: float = 0.0
  attention: str = "auto"
  loss_chunk: int | None = None
  remat: str | None = None
  n_kv_heads: int | None = None
  rope: bool = False
  rope_theta: float = 500000.0

  def __post_init__(self):
    if self.remat == "auto":
      raise ValueError("GPTConfig.remat='auto' would be 'full' here: auto "
                       "is chosen by an engine; leave GPTConfig.remat None "
                       "and set ZeroConfig(remat='auto')")
    if self.remat is not None and self.remat not in REMAT_POLICIES:
      raise ValueError(f"GPTConfig.remat must be None or one of "
                       f"{sorted(set(REMAT_POLICIES) - {'auto'})}, got "
                       f"{self.remat!r}")
    if self.attention not in ATTENTIONS:
      raise ValueError(f"GPTConfig.attention must be one of {ATTENTIONS}, "
                       f"got {self.attention!r}")
    for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads"):
      if getattr(self, name) < 1:
        raise ValueError(f"GPTConfig.{name} must be >= 1, got "
                         f"{getattr(self, name)}")
    if self.d_model % self.n_heads:
      raise ValueError(
          f"GPTConfig.d_model ({self.d_model}) must be divisible by n_heads "
          f"({self.n_heads}) so every head gets d_model // n_heads features; "
          f"e.g. use n_heads={math.gcd(self.d_model, self.n_heads)}.")
    kv = self.kv_heads
    if kv < 1 or self.n_heads % kv:
      fits = [k for k in range(1, min(max(kv, 1), self.n_heads) + 1)
              if self.n_heads % k == 0]
      raise ValueError(
          f"GPTConfig.n_kv_heads ({self.n_kv_heads}) must divide n_heads "
          f"({self.n_heads}): each key/value head serves the same number of "
          f"query heads; e.g. n_kv_heads={fits[-1]}, or None for one per "
          "query head.")
    if self.rope and (self.d_model // self.n_heads) % 2:
      raise ValueError(
          f"GPTConfig.rope rotates pairs of features, but the head size "
          f"d_model // n_heads = {self.d_model // self.n_heads} is odd: use "
          "an even head size, or rope=False.")
    if not self.rope_theta > 0:
      raise ValueError(f"GPTConfig.rope_theta must be > 0, got "
                       f"{self.rope_theta}")
    if self.loss_chunk is not None and self.loss_chunk < 1:
      raise ValueError(f"GPTConfig.loss_chunk must be >= 1 or None, got "
                       f"{self.loss_chunk}")
    if self.d_ff is not None and self.d_ff < 1:
      raise ValueError(f"GPTConfig.d_ff must be >= 1 or None, got {self.d_ff}")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"GPTConfig.dropout must be in [0, 1), got "
                       f"{self.dropout}")

  @property
  def kv_heads(self) -> int:
    """The key/value heads actually used."""
    return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

  @property
  def ff_dim(self) -> int:
    """The MLP hidden width actually used."""
    return 4 * self.d_model if self.d_ff is None else self.d_ff


def llama3_8b(seq_len: int = 8192, **overrides) -> GPTConfig:
  """The reference GPT in Llama 3 8B's shape: width 4096, 32 layers, 32
  query heads over 8 key/value heads, rotary positions (base 500000) and a
  vocabulary of 128256, with Llama 3 8B's 8.03B parameters and its
  matmul FLOPs per token. Its MLP is GELU's two matrices of 21504 (the
  parameters of SwiGLU's three of 14336) and its norms LayerNorm: the
  memory and communication of the real model, not its weights.

  Args:
    seq_len: the longest sequence.
    **overrides: other ``GPTConfig`` fields (``attention``, ``loss_chunk``).
  """
  return GPTConfig(**{
      "vocab_size": 128256, "seq_len": seq_len, "d_model": 4096,
      "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "d_ff": 21504,
      "rope": True, **overrides})


# ----------------------------------------------------------------- pure ops


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
  """LayerNorm over the last axis, with statistics in float32."""
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  var = jnp.square(x32 - mean).mean(-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + _LN_EPS)
  return (y * scale + bias).astype(x.dtype)


def dropout(x: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
  """Inverted dropout; the identity when ``rate == 0`` or ``rng`` is None."""
  if rate == 0.0 or rng is None:
    return x
  keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def block(h: jax.Array, layer_params: dict[str, jax.Array], *, n_heads: int,
          dropout_rate: float = 0.0, rng: jax.Array | None = None,
          attention: str = "einsum", kv_heads: int | None = None,
          rope_theta: float | None = None) -> jax.Array:
  """One pre-LN transformer block: ``h + attn(ln(h))``, then ``+ mlp(ln(.))``.

  A pure function of the hidden state and *one* layer's parameters (a dict
  keyed by ``BLOCK_PARAMS``, without the layer axis), so callers can wrap it,
  e.g. in ``jax.checkpoint`` or with a per-layer parameter gather.

  Args:
    h: hidden state (B, T, d).
    layer_params: this layer's slice of every stacked block parameter.
    n_heads: attention heads.
    dropout_rate: residual dropout rate.
    rng: PRNG key for dropout, or None for no dropout.
    attention: ``GPTConfig.attention``.
    kv_heads: key/value heads (``GPTConfig.n_kv_heads``; None: n_heads).
    rope_theta: the rotary base with ``GPTConfig.rope``; None: no rotary
      positions.

  Returns:
    The new hidden state (B, T, d).
  """
  p = layer_params
  k_attn, k_mlp = (None, None) if rng is None else jax.random.split(rng)
  x = layer_norm(h, p["ln1_scale"], p["ln1_bias"])
  # Tags for the named remat policies (ZeroConfig(remat="save_only_named",
  # remat_names=("attn_output", "mlp_hidden"))).
  x = checkpoint_name(causal_self_attention(x, p["attn_qkv"], p["attn_out"],
                                            p["attn_out_bias"], n_heads,
                                            attention, kv_heads=kv_heads,
                                            rope_theta=rope_theta),
                      "attn_output")
  h = h + dropout(x, dropout_rate, k_attn)
  x = layer_norm(h, p["ln2_scale"], p["ln2_bias"])
  # tanh-approximate GELU, as in GPT-2.
  x = checkpoint_name(
      jax.nn.gelu(x @ p["mlp_in"] + p["mlp_in_bias"], approximate=True),
      "mlp_hidden")
  x = x @ p["mlp_out"] + p["mlp_out_bias"]
  return h + dropout(x, dropout_rate, k_mlp)


# ------------------------------------------------------------------ modules


def _param(value: jax.Array, *split: str | None) -> nnx.Param:
  # split: per dimension, MODEL or None. Flax shards by it eagerly (unless
  # nnx.use_eager_sharding is off), which needs a mesh with a model axis.
  eager = (nnx.using_eager_sharding() and
           MODEL in jax.sharding.get_abstract_mesh().axis_names)
  return nnx.Param(value, out_sharding=split, eager_sharding=eager)


class Blocks(nnx.Module):
  """The stacked parameters of all ``n_layers`` transformer blocks.

  Each attribute named in ``BLOCK_PARAMS`` is one ``nnx.Param`` with a
  leading layer dimension, e.g. ``attn_qkv`` is ``(n_layers, d, 3 d)``
  (``(n_layers, d, (n_heads + 2 n_kv_heads) head_dim)`` grouped).
  """

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    L, d, f, H = config.n_layers, config.d_model, config.ff_dim, config.n_heads
    std = 0.02
    # GPT-2: scale the projections that write into the residual stream by
    # 1/sqrt(2 L) so the stream's variance does not grow with depth.
    out_std = std / math.sqrt(2 * L)
    normal = lambda shape, s: s * jax.random.normal(rngs.params(), shape,
                                                    jnp.float32)
    zeros = lambda *shape: jnp.zeros(shape, jnp.float32)
    ones = lambda *shape: jnp.ones(shape, jnp.float32)

    self.ln1_scale = _param(ones(L, d), None, None)
    self.ln1_bias = _param(zeros(L, d), None, None)
    kv, hd = config.kv_heads, d // H
    if kv == H:
      # Drawn [q | k | v] (the packing before head-major), then stored
      # head-major: a seed gives the same model as it did then.
      qkv = normal((L, d, 3 * d), std).reshape(L, d, 3, H, hd)
      qkv = qkv.swapaxes(2, 3).reshape(L, d, 3 * d)
    else:
      # Grouped-query: drawn in its packing, (kv, group + 2, head_dim).
      qkv = normal((L, d, (H + 2 * kv) * hd), std)
    self.attn_qkv = _param(qkv, None, None, MODEL)
    self.attn_out = _param(normal((L, d, d), out_std), None, MODEL, None)
    self.attn_out_bias = _param(zeros(L, d), None, None)
    self.ln2_scale = _param(ones(L, d), None, None)
    self.ln2_bias = _param(zeros(L, d), None, None)
    self.mlp_in = _param(normal((L, d, f), std), None, None, MODEL)
    self.mlp_in_bias = _param(zeros(L, f), None, MODEL)
    self.mlp_out = _param(normal((L, f, d), out_std), None, MODEL, None)
    self.mlp_out_bias = _param(zeros(L, d), None, None)

  def stacked(self) -> dict[str, jax.Array]:
    """The stacked arrays, keyed by ``BLOCK_PARAMS`` (each ``(L, ...)``)."""
    return {name: getattr(self, name)[...] for name in BLOCK_PARAMS}


class GPT(nnx.Module):
  """A GPT-style decoder-only transformer.

  Args:
    config: the model's shape.
    rngs: PRNG streams; ``rngs.params()`` initialises the weights.
  """

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    self.config = config
    d, v = config.d_model, config.vocab_size
    normal = lambda *shape: 0.02 * jax.random.normal(rngs.params(), shape)
    self.tok_emb = _param(normal(v, d), MODEL, None)
    # (Rotary positions replace the learned ones.)
    self.pos_emb = (None if config.rope else
                    _param(normal(config.seq_len, d), None, None))
    self.blocks = Blocks(config, rngs=rngs)
    self.ln_f_scale = _param(jnp.ones((d,), jnp.float32), None)
    self.ln_f_bias = _param(jnp.zeros((d,), jnp.float32), None)
    # Untied from tok_emb: simpler to shard and to reason about.
    self.head = _param(normal(d, v), None, MODEL)

  def __call__(self, tokens: jax.Array, *,
               rng: jax.Array | None = None) -> jax.Array:
    """Next-token logits.

    Args:
      tokens: int token ids (B, T) with ``T <= config.seq_len``.
      rng: PRNG key for dropout; None (or ``config.dropout == 0``) means no
        dropout.

    Returns:
      float32 logits (B, T, vocab_size).
    """
    return (self.hidden(tokens, rng=rng) @ self.head[...]).astype(
        jnp.float32)

  def hidden(self, tokens: jax.Array, *,
             rng: jax.Array | None = None) -> jax.Array:
    """The final hidden state (B, T, d_model) that the head reads
    (``__call__``'s arguments)."""
    gpt = self.config
    t = tokens.shape[-1]
    if t > gpt.seq_len:
      raise ValueError(f"input has {t} tokens but the model was built for "
                       f"seq_len={gpt.seq_len}")
    use_dropout = gpt.dropout > 0 and rng is not None
    if not use_dropout:
      rng = None

    h = self.tok_emb[...][tokens]
    if self.pos_emb is not None:
      h = h + self.pos_emb[...][:t]
    if rng is not None:
      h = dropout(h, gpt.dropout, jax.random.fold_in(rng, gpt.n_layers))

    def body(h, xs):
      layer_params, i = xs
      # Fold in the layer index so each layer drops different units.
      key = None if rng is None else jax.random.fold_in(rng, i)
      h = block(h, layer_params, n_heads=gpt.n_heads,
                dropout_rate=gpt.dropout, rng=key,
                attention=gpt.attention, kv_heads=gpt.n_kv_heads,
                rope_theta=gpt.rope_theta if gpt.rope else None)
      return h, None

    xs = (self.blocks.stacked(), jnp.arange(gpt.n_layers))
    # scan_layers is lax.scan that, under a ZeRO engine, gathers (stage 3)
    # or reduce-scatters the gradients of (stage 2) one layer at a time.
    h, _ = scan_layers(body, h, xs, remat=gpt.remat)

    return layer_norm(h, self.ln_f_scale[...], self.ln_f_bias[...])


def make_loss_fn(graphdef: nnx.GraphDef) -> Callable[..., jax.Array]:
  """Builds a pure loss over the model's parameter state.

  Args:
    graphdef: from ``graphdef, params = nnx.split(model, nnx.Param)``.

  Returns:
    ``loss_fn(params, batch, rng=None)``: the mean next-token cross-entropy
    (float32) of ``batch["tokens"]``, an int array (B, seq_len + 1): the
    model reads tokens ``[:, :-1]`` and predicts ``[:, 1:]``. ``rng`` enables
    dropout (pass it with ``Engine(..., with_rng=True)``).
  """

  def loss_fn(params: Any, batch: dict[str, jax.Array],
              rng: jax.Array | None = None) -> jax.Array:
    model = nnx.merge(graphdef, params)
    tokens = batch["tokens"]
    chunk = model.config.loss_chunk
    if chunk is not None:
      h = model.hidden(tokens[:, :-1], rng=rng)
      return chunked_cross_entropy(h, model.head[...], tokens[:, 1:], chunk)
    logits = model(tokens[:, :-1], rng=rng)
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), tokens[:, 1:])
    return losses.mean()

  return loss_fn
