"""The reference GPT's ZeRO train step, compiled for GPUs you do not have.

``compile_gpt`` builds ``zero_jax.models.GPT`` of a given shape from shapes
alone (``gpt_shapes``), an ``Engine`` for it on compile-only GPUs
(``gpu_mesh``) and compiles its step (``compile_step``): what the command
line's ``--compile TARGET`` prints, and what the tests of GPU programs
measure.

``compile_gspmd_gpt`` compiles the peer it is held against: a MaxText-style
GSPMD FSDP step, one plain ``jax.jit`` of the same loss, gradient and optax
update with the parameters and optimizer state laid out as ZeRO-3 lays them
out and every collective left to XLA (``compile_gspmd_step``, the loss
``pinned_gpt_loss``).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from zero_jax.analysis import _aot as aot
from zero_jax.analysis import _hlo as hlo
from zero_jax.analysis import _measure as measure
from zero_jax.analysis import _transfers as transfers_
from zero_jax.config import ZeroConfig
from zero_jax.layers import scan_layers
from zero_jax.layout import DATA, Plan, layout_mesh


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
                ) -> tuple[Any, aot.CompiledStep]:
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
    ValueError, ImportError, RuntimeError: as ``gpu_devices``.
  """
  # Imported here: the analytic estimate needs neither optax nor the model.
  # pylint: disable=g-import-not-at-top
  from zero_jax.models import make_loss_fn
  from zero_jax.train import Engine
  # pylint: enable=g-import-not-at-top

  tx = _optimizer(optimizer)
  # The mesh first: compile-only GPUs must be asked for before anything
  # else touches JAX's devices (see ``gpu_devices``).
  mesh = aot.gpu_mesh(target, devices, replica=replica, model=model)
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
  return engine, aot.compile_step(engine, params, batch)


def _optimizer(name: str):
  """``compile_gpt``'s ``optimizer``: an optax optimizer by name, or with
  ``fused_``, ``zero_jax.offload``'s (the fused host optimizer's)."""
  # pylint: disable=g-import-not-at-top
  import optax

  from zero_jax import offload
  # pylint: enable=g-import-not-at-top
  lib, name = ((offload, name[len("fused_"):]) if name.startswith("fused_")
               else (optax, name))
  return (lib.sgd(1e-4, momentum=0.9) if name == "sgd_momentum" else
          getattr(lib, name)(1e-4))


def gpt_shapes(*, layers: int, hidden: int, heads: int, vocab: int,
               seq_len: int, attention: str = "fused") -> tuple[Any, Any]:
  """``(graphdef, params)`` of the reference GPT, params as shapes only."""
  # pylint: disable=g-import-not-at-top
  from flax import nnx

  from zero_jax.models import GPT, GPTConfig
  # pylint: enable=g-import-not-at-top
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
  # pylint: disable=g-import-not-at-top
  import optax
  from flax import nnx

  from zero_jax.models import block, layer_norm
  # pylint: enable=g-import-not-at-top
  batch_sharded = NamedSharding(mesh, P(DATA))
  pin = lambda x: jax.lax.with_sharding_constraint(x, batch_sharded)

  def loss_fn(params, batch):
    if compute_dtype is not None:
      params = jax.tree.map(lambda x: x.astype(compute_dtype), params)
    model = nnx.merge(graphdef, params)
    cfg = model.config
    tokens = batch["tokens"]
    inputs = tokens[:, :-1]
    h = pin(model.tok_emb[...][inputs] + model.pos_emb[...][:inputs.shape[1]])

    def body(h, layer):
      return pin(block(h, layer, n_heads=cfg.n_heads,
                       attention=attention or cfg.attention)), None

    h, _ = scan_layers(body, h, model.blocks.stacked(),
                       remat=remat if remat is not None else cfg.remat)
    h = layer_norm(h, model.ln_f_scale[...], model.ln_f_bias[...])
    logits = pin((h @ model.head[...]).astype(jnp.float32))
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, tokens[:, 1:]).mean()

  return loss_fn


def compile_gspmd_step(loss_fn: Any, tx: Any, params: Any, batch: Any,
                       mesh: jax.sharding.Mesh, *,
                       min_shard_elements: int | None = None
                       ) -> tuple[Any, aot.CompiledStep]:
  """Compiles one plain ``jax.jit`` train step laid out like ZeRO-3, every
  collective left to GSPMD (FSDP as MaxText and ``jax.jit`` users write it).

  Parameters and every optimizer-state leaf are split over ``data`` on
  their largest divisible dimension by ``zero_jax.layout.Plan`` at stage 3
  with the engine's threshold (the same layout as the engine's stage-3
  state), the batch on its leading dimension. The step is
  ``value_and_grad`` + ``tx.update`` + ``apply_updates``, parameters and
  optimizer state donated. Nothing is materialised: it is lowered from
  shapes and shardings, on real devices or compile-only GPUs
  (``gpu_mesh``).

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar`` (e.g.
      ``pinned_gpt_loss``).
    tx: the optax optimizer.
    params: the parameters, or their shapes.
    batch: the global batch, or its shapes.
    mesh: a one-axis ``data`` mesh.
    min_shard_elements: leaves smaller than this stay replicated; None:
      ``ZeroConfig``'s default, as the engine does.

  Returns:
    ``(state, compiled)``: ``state`` is ``(params, opt_state)`` as
    ``jax.ShapeDtypeStruct`` with their shardings (``per_device_bytes``
    measures them) and ``compiled`` the ``CompiledStep``.
  """
  import optax  # pylint: disable=g-import-not-at-top
  if min_shard_elements is None:
    min_shard_elements = ZeroConfig().min_shard_elements
  abstract = lambda tree, shardings: jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      tree, shardings)
  param_sh = Plan(params, mesh, 3, min_shard_elements).shardings
  opt_shapes = jax.eval_shape(tx.init, params)
  opt_sh = Plan(opt_shapes, mesh, 3, min_shard_elements).shardings
  batch_sh = jax.tree.map(
      lambda _: NamedSharding(layout_mesh(mesh), P(DATA)), batch)

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  jitted = jax.jit(step, in_shardings=(param_sh, opt_sh, batch_sh),
                   out_shardings=(param_sh, opt_sh,
                                  NamedSharding(layout_mesh(mesh), P())),
                   donate_argnums=(0, 1))
  state = (abstract(params, param_sh), abstract(opt_shapes, opt_sh))
  with jax.set_mesh(mesh):
    compiled = jitted.lower(*state, abstract(batch, batch_sh)).compile()
  text = compiled.as_text()
  return state, aot.CompiledStep(
      memory=measure.compiled_memory(compiled),
      collectives=hlo.summarize_by_dtype(text), hlo=text,
      params=measure.param_count(params),
      transfers=transfers_.host_transfers(text))


def compile_gspmd_gpt(target: str, devices: int, *, layers: int, hidden: int,
                      heads: int, vocab: int, seq_len: int, micro_batch: int,
                      compute_dtype: str | None = "bfloat16",
                      remat: str = "full", attention: str = "fused",
                      optimizer: str = "adamw"
                      ) -> tuple[Any, aot.CompiledStep]:
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
    ``(state, compiled)`` as ``compile_gspmd_step``.

  Raises:
    ValueError, ImportError, RuntimeError: as ``gpu_devices``.
  """
  tx = _optimizer(optimizer)
  # The mesh first (see ``gpu_devices``).
  mesh = aot.gpu_mesh(target, devices)
  graphdef, params = gpt_shapes(layers=layers, hidden=hidden, heads=heads,
                                vocab=vocab, seq_len=seq_len,
                                attention=attention)
  batch = {"tokens": jax.ShapeDtypeStruct((micro_batch * devices,
                                           seq_len + 1), jnp.int32)}
  loss_fn = pinned_gpt_loss(graphdef, mesh, compute_dtype=compute_dtype,
                            remat=remat)
  return compile_gspmd_step(loss_fn, tx, params, batch, mesh)
