"""The DeepSpeed keys outside the ZeroConfig map, and the value readers.

``from_deepspeed`` (``zero_jax.config``) translates the keys of its
``MAPPING`` table into ``ZeroConfig`` fields; this module holds what it does
with every other key (accepted without effect, accepted at DeepSpeed's
default only, refused with a reason) and the readers of a JSON value: the
package's shared checks, each naming the dotted key in its error.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Mapping
import warnings

from zero_jax._checks import check_bool, check_float, check_int, check_str

ANY = object()  # a key of NO_EFFECT_KEYS that accepts any valid value


def key_name(path: str) -> str:
  """How an error names the dotted key ``path``."""
  return f"DeepSpeed config key {path!r}"


def as_bool(path: str, value: Any) -> bool:
  return check_bool(key_name(path), value, what="true or false")


def as_int(path: str, value: Any, *, minimum: int) -> int:
  return check_int(key_name(path), value, minimum)


def as_number(path: str, value: Any, *, minimum: float,
              strict: bool = False) -> float:
  return check_float(key_name(path), value, minimum, strict=strict)


def as_size(path: str, value: Any) -> int:
  """A size >= 0; an integral float too, as JSON writes 5e8."""
  if isinstance(value, float) and value.is_integer():
    value = int(value)
  return as_int(path, value, minimum=0)


def as_count(path: str, value: Any) -> int:
  return as_int(path, value, minimum=1)


def as_float(path: str, value: Any) -> float:
  return as_number(path, value, minimum=0.0, strict=True)


def as_str(path: str, value: Any) -> str:
  return check_str(key_name(path), value)


# Keys that change only how DeepSpeed schedules its communication, or what
# it prints: XLA's scheduler decides that for zero_jax, and results do not
# depend on them. Accepted (with a type check) and reported in one warning.
# Value: (validator, the only accepted value or ANY).
NO_EFFECT_KEYS: Mapping[str, tuple[Callable[[str, Any], Any], Any]] = {
    "zero_optimization.overlap_comm": (as_bool, ANY),
    "zero_optimization.contiguous_gradients": (as_bool, ANY),
    "zero_optimization.reduce_scatter": (as_bool, ANY),
    "zero_optimization.allgather_partitions": (as_bool, ANY),
    "zero_optimization.reduce_bucket_size": (as_size, ANY),
    "zero_optimization.allgather_bucket_size": (as_size, ANY),
    "zero_optimization.use_multi_rank_bucket_allreduce": (as_bool, ANY),
    "zero_optimization.stage3_prefetch_bucket_size": (as_size, ANY),
    "zero_optimization.stage3_max_live_parameters": (as_size, ANY),
    "zero_optimization.stage3_max_reuse_distance": (as_size, ANY),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": (as_bool, ANY),
    "zero_optimization.stage3_module_granularity_threshold": (as_size, ANY),
    "zero_optimization.sub_group_size": (as_size, ANY),
    "zero_optimization.round_robin_gradients": (as_bool, ANY),
    "zero_optimization.memory_efficient_linear": (as_bool, ANY),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save":
        (as_bool, ANY),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save":
        (as_bool, ANY),
    "zero_optimization.elastic_checkpoint": (as_bool, ANY),
    "zero_optimization.load_from_fp32_weights": (as_bool, ANY),
    "steps_per_print": (as_size, ANY),
    "wall_clock_breakdown": (as_bool, ANY),
    "zero_allow_untested_optimizer": (as_bool, ANY),
    "zero_force_ds_cpu_optimizer": (as_bool, ANY),
    "dump_state": (as_bool, ANY),
    "prescale_gradients": (as_bool, False),
    "gradient_predivide_factor": (as_float, 1.0),
}

_NOT_IMPLEMENTED = "a DeepSpeed feature that zero_jax does not implement"
_DEPRECATED_PARAM_OFFLOAD = (
    "deprecated in DeepSpeed: write offload_param: {\"device\": \"cpu\"}")
_ZERO_PP = ("ZeRO++ (quantized or hierarchical communication) is not "
            "implemented in zero_jax")
_MONITOR = ("zero_jax does not log: log the metrics returned by Engine.step "
            "(loss, grad_norm, ...) with your own logger")
_PREDIVIDE = (
    "zero_jax sums gradients in reduce_dtype (float32 unless "
    "communication_data_type says otherwise) and divides once; "
    "pre-division is not implemented")

# Keys DeepSpeed knows that zero_jax does not honour, with why and what to do.
UNSUPPORTED_WHY: Mapping[str, str] = {
    "optimizer": (
        "zero_jax does not build optimizers: build the optimizer with optax "
        "(e.g. optax.adamw(learning_rate, b1, b2, eps, weight_decay)) and "
        "pass it to Engine as tx"),
    "scheduler": (
        "zero_jax does not build learning-rate schedules: build one with "
        "optax (e.g. optax.warmup_cosine_decay_schedule) and pass it as the "
        "learning_rate of the optax optimizer given to Engine"),
    "amp": "NVIDIA Apex AMP is PyTorch-only; use bf16.enabled or fp16.enabled",
    "activation_checkpointing": (
        "rematerialization is ZeroConfig.remat (applied per layer by "
        "zero_jax.scan_layers); set it on the result with "
        "dataclasses.replace(config, remat=...)"),
    "tensorboard": _MONITOR,
    "wandb": _MONITOR,
    "csv_monitor": _MONITOR,
    "comet": _MONITOR,
    "comms_logger": _MONITOR,
    "flops_profiler": (
        "use jax.profiler, or cost_analysis() of the lowered step "
        "(engine.step.lower(state, batch).compile())"),
    "pipeline": "pipeline parallelism is not implemented in zero_jax",
    "moe": "mixture-of-experts parallelism is not implemented in zero_jax",
    "sparse_attention": _NOT_IMPLEMENTED,
    "sparse_gradients": _NOT_IMPLEMENTED,
    "compression_training": _NOT_IMPLEMENTED,
    "quantize_training": _NOT_IMPLEMENTED,
    "elasticity": _NOT_IMPLEMENTED,
    "autotuning": _NOT_IMPLEMENTED,
    "data_efficiency": _NOT_IMPLEMENTED,
    "curriculum_learning": _NOT_IMPLEMENTED,
    "progressive_layer_drop": _NOT_IMPLEMENTED,
    "eigenvalue": _NOT_IMPLEMENTED,
    "hybrid_engine": _NOT_IMPLEMENTED,
    "compile": "zero_jax's step is always compiled by XLA (jax.jit)",
    "checkpoint": ("zero_jax does not write checkpoints itself: save the "
                   "TrainState with orbax"),
    "nebula": ("zero_jax does not write checkpoints itself: save the "
               "TrainState with orbax"),
    "aio": "disk (NVMe) offload does not exist in zero_jax",
    "dataloader_drop_last": "zero_jax does not build data loaders",
    "memory_breakdown": "use zero_jax.estimate_memory or jax's memory stats",
    "disable_allgather": _NOT_IMPLEMENTED,
    "prescale_gradients": _PREDIVIDE,
    "gradient_predivide_factor": _PREDIVIDE,
    "fp16.auto_cast": (
        "zero_jax casts the parameters, not the batch: cast floating inputs "
        "to float16 inside loss_fn"),
    "fp16.fp16_master_weights_and_grads": (
        "master weights and gradients stay float32 in zero_jax"),
    "data_types.grad_accum_dtype": (
        "zero_jax accumulates gradients in float32; write \"fp32\""),
    "zero_optimization.cpu_offload": (
        "deprecated in DeepSpeed: write offload_optimizer: {\"device\": "
        "\"cpu\"}"),
    "zero_optimization.cpu_offload_param": _DEPRECATED_PARAM_OFFLOAD,
    "zero_optimization.cpu_offload_use_pin_memory": (
        "deprecated in DeepSpeed: write offload_optimizer.pin_memory"),
    "zero_optimization.stage3_model_persistence_threshold": (
        "zero_jax has no cap on the total size of replicated parameters: "
        "stage3_param_persistence_threshold (min_shard_elements) alone "
        "decides; Engine.describe() lists every replicated leaf"),
    "zero_optimization.zero_quantized_weights": _ZERO_PP,
    "zero_optimization.zero_quantized_nontrainable_weights": _ZERO_PP,
    "zero_optimization.zero_quantized_gradients": _ZERO_PP,
    "zero_optimization.zero_hpz_partition_size": _ZERO_PP,
    "zero_optimization.zeropp_loco_param": _ZERO_PP,
    "zero_optimization.mics_shard_size": (
        "MiCS is not implemented as such: make_mesh(replica=R) shards the "
        "state inside groups of devices // R and replicates it across them"),
    "zero_optimization.mics_hierarchical_params_gather": _NOT_IMPLEMENTED,
    "zero_optimization.ignore_unused_parameters": (
        "zero_jax gives unused parameters zero gradients and never checks "
        "for them (DeepSpeed's default, true)"),
    "zero_optimization.legacy_stage1": _NOT_IMPLEMENTED,
}

# Keys that are harmless at DeepSpeed's default (writing the default out is
# common); any other value is unsupported, for the reason above.
DEFAULT_ONLY: Mapping[str, Any] = {
    "fp16.auto_cast": False,
    "fp16.fp16_master_weights_and_grads": False,
    "zero_optimization.cpu_offload": False,
    "zero_optimization.cpu_offload_param": False,
    "zero_optimization.zero_quantized_weights": False,
    "zero_optimization.zero_quantized_nontrainable_weights": False,
    "zero_optimization.zero_quantized_gradients": False,
    "zero_optimization.zero_hpz_partition_size": 1,
    "zero_optimization.mics_shard_size": -1,
    "zero_optimization.mics_hierarchical_params_gather": False,
    "zero_optimization.ignore_unused_parameters": True,
    "zero_optimization.legacy_stage1": False,
}

UNKNOWN = ("not a DeepSpeed key that zero_jax knows (check the spelling "
           "against DeepSpeed's config documentation)")

DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16",
          "float16": "float16", "half": "float16", "bf16": "bfloat16",
          "bfloat16": "bfloat16"}


def load_config(config: Any) -> tuple[Mapping[str, Any], str | None]:
  """The config as a mapping, and the path it was read from (if any)."""
  if isinstance(config, Mapping):
    return config, None
  if not isinstance(config, (str, os.PathLike)):
    raise TypeError("from_deepspeed takes a path to a DeepSpeed JSON file or "
                    f"a dict, got {type(config).__name__}")
  path = os.fspath(config)
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except FileNotFoundError:
    hint = ("; to read a JSON string, pass json.loads(s)"
            if str(path).lstrip().startswith("{") else "")
    raise FileNotFoundError(
        f"DeepSpeed config file {path!r} does not exist{hint}") from None
  except OSError as e:
    raise OSError(f"cannot read DeepSpeed config file {path!r}: {e}") from e
  try:
    data = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(
        f"DeepSpeed config file {path!r} is not valid JSON: {e}") from None
  if not isinstance(data, dict):
    raise ValueError(f"DeepSpeed config file {path!r} must hold a JSON "
                     f"object, got {type(data).__name__}")
  return data, path


def warn(message: str) -> None:
  """Warns at the first frame outside zero_jax (the user's call)."""
  package = os.path.dirname(os.path.abspath(__file__))
  level, frame = 1, sys._getframe(0)  # pylint: disable=protected-access
  while frame is not None and os.path.abspath(
      frame.f_code.co_filename).startswith(package + os.sep):
    frame, level = frame.f_back, level + 1
  warnings.warn(message, UserWarning, stacklevel=level)


def is_auto(value: Any) -> bool:
  return isinstance(value, str) and value.strip().lower() == "auto"

