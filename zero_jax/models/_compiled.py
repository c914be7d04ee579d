"""The reference GPT's ZeRO train step, compiled for GPUs you do not have.

``compile_gpt`` builds ``zero_jax.models.GPT`` of a given shape from shapes
alone (``gpt_shapes``), an ``Engine`` for it on compile-only GPUs
(``zero_jax.analysis.gpu_mesh``) and compiles its step
(``zero_jax.analysis.compile_step``): what ``python -m zero_jax.estimate
--compile TARGET`` prints, and what the tests of GPU programs measure.

``compile_gspmd_gpt`` compiles the peer it is held against: a MaxText-style
GSPMD FSDP step, one plain ``jax.jit`` of the same loss, gradient and optax
update with the parameters and optimizer state laid out as ZeRO-3 lays them
out and every collective left to XLA (``zero_jax.analysis``'
``compile_gspmd_step``, the loss ``pinned_gpt_loss``).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from zero_jax import analysis, offload
from zero_jax.config import ZeroConfig
from zero_jax.layers import scan_layers
from zero_jax.layout import DATA
from zero_jax.models._gpt import (GPT, GPTConfig, block, layer_norm,
                                  make_loss_fn)


def compile_gpt(target: str, devices: int, stage: int, *, layers: int,
                hidden: int, heads: int, vocab: int, seq_len: int,
                micro_batch: int, compute_dtype: str | None = "bfloat16",
                remat: str = "full", attention: str = "fused",
                optimizer: str = "adamw", replica: int = 1,
                model: int = 1, partition_activations: bool = False,
                offload_optimizer: bool = False,
                offload_params: bool = False,
                update_on: str = "device",
                reduce_dtype: str | None = None,
                overrides: Mapping[str, Any] | None = None
                ) -> tuple[Any, analysis.CompiledStep]:
  """Compiles the reference GPT's ZeRO train step for ``devices`` GPUs.

  The model is ``zero_jax.models.GPT`` of the given shape (learned
  positions, untied head), trained from shapes alone: nothing is
  materialised.

  Args:
    target: a GPU of ``zero_jax.analysis.TARGETS`` (``"h100"``, ...).
    devices: number of GPUs.
    stage: ZeRO stage.
    layers, hidden, heads, vocab, seq_len: the GPT's shape.
    micro_batch: sequences per data-parallel rank per step.
    compute_dtype: ``ZeroConfig.compute_dtype``.
    remat: ``ZeroConfig.remat``.
    attention: ``GPTConfig.attention``.
    optimizer: an optax optimizer without arguments beyond the learning
      rate (``adamw``, ``adam``, ``sgd``, ``sgd_momentum``, ``lion``,
      ``adafactor``), or ``fused_`` and one of ``adamw``, ``adam``, ``sgd``,
      ``sgd_momentum``, ``lion``, ``adagrad``: ``zero_jax.offload``'s.
    replica: replica groups of the mesh.
    model: devices per tensor-parallel group (the mesh's ``model`` axis;
      the GPT splits itself over it Megatron-style).
    partition_activations: ``ZeroConfig.partition_activations`` (Pa).
    offload_optimizer, offload_params, update_on: the ``ZeroConfig``
      offload options (with ``update_on="host"`` the device's program is
      compiled; the host's update is a program of its own).
    reduce_dtype: ``ZeroConfig.reduce_dtype``.
    overrides: any other ``ZeroConfig`` fields (they take precedence over
      the arguments above), e.g. ``{"min_shard_elements": 0}``.

  Returns:
    ``(engine, compiled)``: the ``Engine`` (its plans say what is sharded)
    and the ``zero_jax.analysis.CompiledStep``.

  Raises:
    ValueError, ImportError, RuntimeError: as ``zero_jax.analysis.gpu_devices``.
  """
  # Imported here: the models load without the engine.
  from zero_jax.train import Engine  # pylint: disable=g-import-not-at-top

  tx = _optimizer(optimizer)
  # The mesh first: compile-only GPUs must be asked for before anything
  # else touches JAX's devices (see ``zero_jax.analysis.gpu_devices``).
  mesh = analysis.gpu_mesh(target, devices, replica=replica, model=model)
  graphdef, params = gpt_shapes(layers=layers, hidden=hidden, heads=heads,
                                vocab=vocab, seq_len=seq_len,
                                attention=attention)
  fields = dict(stage=stage, compute_dtype=compute_dtype, remat=remat,
                offload_optimizer="host" if offload_optimizer else None,
                offload_params="host" if offload_params else None,
                update_on=update_on, reduce_dtype=reduce_dtype,
                partition_activations=partition_activations)
  config = ZeroConfig(**{**fields, **(overrides or {})})
  engine = Engine(make_loss_fn(graphdef), tx, config, mesh)
  # (The batch is split over the replica and data axes, not over model.)
  batch = {"tokens": jax.ShapeDtypeStruct((micro_batch * devices // model,
                                           seq_len + 1), jnp.int32)}
  return engine, analysis.compile_step(engine, params, batch)


def _optimizer(name: str):
  """``compile_gpt``'s ``optimizer``: an optax optimizer by name, or with
  ``fused_``, ``zero_jax.offload``'s (the fused host optimizer's)."""
  lib, name = ((offload, name[len("fused_"):]) if name.startswith("fused_")
               else (optax, name))
  return (lib.sgd(1e-4, momentum=0.9) if name == "sgd_momentum" else
          getattr(lib, name)(1e-4))


def gpt_shapes(*, layers: int, hidden: int, heads: int, vocab: int,
               seq_len: int, attention: str = "fused") -> tuple[Any, Any]:
  """``(graphdef, params)`` of the reference GPT, params as shapes only."""
  cfg = GPTConfig(vocab_size=vocab, seq_len=seq_len, d_model=hidden,
                  n_layers=layers, n_heads=heads, attention=attention)
  return nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))),
                   nnx.Param)


# ------------------------------------------------------------ the GSPMD peer


def pinned_gpt_loss(graphdef: Any, mesh: jax.sharding.Mesh, *,
                    compute_dtype: str | None = None,
                    remat: str | None = None,
                    attention: str | None = None) -> Any:
  """The reference GPT's loss with its activations pinned to the batch
  sharding: the loss of a MaxText-style GSPMD FSDP step.

  The forward of ``GPT.__call__`` (the same pure ops and the same
  ``scan_layers``, which outside an engine is a remat'd ``lax.scan``) and
  the mean cross-entropy of ``make_loss_fn``, plus a constraint to the
  batch sharding (``P("data")``) on the hidden state at every block
  boundary and on the logits, as MaxText's logical ``activation_batch``
  annotations do. Without them GSPMD shards the activations like the
  weights instead of gathering the weights.

  Args:
    graphdef: from ``gpt_shapes`` (or ``nnx.split(model, nnx.Param)``).
    mesh: a mesh with a ``data`` axis, which the batch is split over.
    compute_dtype: forward and backward in this dtype: the float32
      parameters are cast to it inside the loss (mixed precision; the
      engine's ``ZeroConfig.compute_dtype``); None: as stored.
    remat: the layer scan's ``REMAT_POLICIES`` name; None: the model's
      ``GPTConfig.remat``, else ``"full"`` (``scan_layers``' default
      outside an engine).
    attention: ``GPTConfig.attention``; None: the model's.

  Returns:
    ``loss_fn(params, batch)``: the mean next-token cross-entropy (float32)
    of ``batch["tokens"]`` (B, seq_len + 1). The GPT's ``loss_chunk`` and
    dropout are not applied.
  """
  batch_sharded = NamedSharding(mesh, P(DATA))
  pin = lambda x: jax.lax.with_sharding_constraint(x, batch_sharded)

  def loss_fn(params, batch):
    if compute_dtype is not None:
      params = jax.tree.map(lambda x: x.astype(compute_dtype), params)
    model = nnx.merge(graphdef, params)
    gpt = model.config
    tokens = batch["tokens"]
    inputs = tokens[:, :-1]
    h = model.tok_emb[...][inputs]
    if model.pos_emb is not None:
      h = h + model.pos_emb[...][:inputs.shape[1]]
    h = pin(h)

    def body(h, layer):
      return pin(block(h, layer, n_heads=gpt.n_heads,
                       attention=attention or gpt.attention,
                       kv_heads=gpt.n_kv_heads,
                       rope_theta=gpt.rope_theta if gpt.rope else None)), None

    h, _ = scan_layers(body, h, model.blocks.stacked(),
                       remat=remat if remat is not None else gpt.remat)
    h = layer_norm(h, model.ln_f_scale[...], model.ln_f_bias[...])
    logits = pin((h @ model.head[...]).astype(jnp.float32))
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]).mean()

  return loss_fn


def compile_gspmd_gpt(target: str, devices: int, *, layers: int, hidden: int,
                      heads: int, vocab: int, seq_len: int, micro_batch: int,
                      compute_dtype: str | None = "bfloat16",
                      remat: str = "full", attention: str = "fused",
                      optimizer: str = "adamw"
                      ) -> tuple[Any, analysis.CompiledStep]:
  """Compiles the GSPMD FSDP peer of ``compile_gpt``'s stage-3 step.

  The same GPT, batch, optimizer, mixed precision and remat as
  ``compile_gpt(target, devices, 3, ...)`` with the same arguments, as one
  plain ``jax.jit`` (``compile_gspmd_step`` of ``pinned_gpt_loss``): the
  layout of the engine's stage-3 state, activations pinned to the batch
  sharding, the collectives GSPMD's.

  Args:
    target, devices, layers, hidden, heads, vocab, seq_len, micro_batch,
      compute_dtype, attention, optimizer: as ``compile_gpt``'s.
    remat: the layer scan's remat policy, as the engine's ``ZeroConfig.
      remat`` (not ``"auto"``, which an engine chooses).

  Returns:
    ``(state, compiled)`` as ``zero_jax.analysis.compile_gspmd_step``.

  Raises:
    ValueError, ImportError, RuntimeError: as ``zero_jax.analysis.gpu_devices``.
  """
  tx = _optimizer(optimizer)
  # The mesh first (see ``zero_jax.analysis.gpu_devices``).
  mesh = analysis.gpu_mesh(target, devices)
  graphdef, params = gpt_shapes(layers=layers, hidden=hidden, heads=heads,
                                vocab=vocab, seq_len=seq_len,
                                attention=attention)
  batch = {"tokens": jax.ShapeDtypeStruct((micro_batch * devices,
                                           seq_len + 1), jnp.int32)}
  loss_fn = pinned_gpt_loss(graphdef, mesh, compute_dtype=compute_dtype,
                            remat=remat)
  return analysis.compile_gspmd_step(loss_fn, tx, params, batch, mesh)
