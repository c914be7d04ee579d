"""The reference GPT's ZeRO train step, compiled for GPUs you do not have.

``compile_gpt`` builds ``zero_jax.models.GPT`` of a given shape from shapes
alone (``gpt_shapes``), an ``Engine`` for it on compile-only GPUs
(``gpu_mesh``) and compiles its step (``compile_step``): what the command
line's ``--compile TARGET`` prints, and what the tests of GPU programs
measure.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zero_jax.analysis import _aot as aot
from zero_jax.config import ZeroConfig


def compile_gpt(target: str, devices: int, stage: int, *, layers: int,
                hidden: int, heads: int, vocab: int, seq_len: int,
                micro_batch: int, compute_dtype: str | None = "bfloat16",
                remat: str = "full", attention: str = "fused",
                optimizer: str = "adamw", replica: int = 1,
                model: int = 1, partition_activations: bool = False,
                offload_optimizer: bool = False,
                offload_params: bool = False,
                update_on: str = "device",
                reduce_dtype: str | None = None
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
      ``adafactor``).
    replica: replica groups of the mesh.
    model: devices per tensor-parallel group (the mesh's ``model`` axis;
      the GPT splits itself over it Megatron-style).
    partition_activations: ``ZeroConfig.partition_activations`` (Pa).
    offload_optimizer, offload_params, update_on: the ``ZeroConfig``
      offload options (with ``update_on="host"`` the device's program is
      compiled; the host's update is a program of its own).
    reduce_dtype: ``ZeroConfig.reduce_dtype``.

  Returns:
    ``(engine, compiled)``: the ``Engine`` (its plans say what is sharded)
    and the ``zero_jax.analysis.CompiledStep``.

  Raises:
    ValueError, ImportError, RuntimeError: as ``gpu_devices``.
  """
  # Imported here: the analytic estimate needs neither optax nor the model.
  # pylint: disable=g-import-not-at-top
  import optax

  from zero_jax.models import make_loss_fn
  from zero_jax.train import Engine
  # pylint: enable=g-import-not-at-top

  tx = (optax.sgd(1e-4, momentum=0.9) if optimizer == "sgd_momentum" else
        getattr(optax, optimizer)(1e-4))
  # The mesh first: compile-only GPUs must be asked for before anything
  # else touches JAX's devices (see ``gpu_devices``).
  mesh = aot.gpu_mesh(target, devices, replica=replica, model=model)
  graphdef, params = gpt_shapes(layers=layers, hidden=hidden, heads=heads,
                                vocab=vocab, seq_len=seq_len,
                                attention=attention)
  config = ZeroConfig(stage=stage, compute_dtype=compute_dtype, remat=remat,
                      offload_optimizer="host" if offload_optimizer else None,
                      offload_params="host" if offload_params else None,
                      update_on=update_on, reduce_dtype=reduce_dtype,
                      partition_activations=partition_activations)
  engine = Engine(make_loss_fn(graphdef), tx, config, mesh)
  # (The batch is split over the replica and data axes, not over model.)
  batch = {"tokens": jax.ShapeDtypeStruct((micro_batch * devices // model,
                                           seq_len + 1), jnp.int32)}
  return engine, aot.compile_step(engine, params, batch)


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
