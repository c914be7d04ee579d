"""The DeepSpeed keys outside the ZeroConfig map, and the value readers.

``from_deepspeed`` (``zero_jax.config``) translates the keys of its
``MAPPING`` table into ``ZeroConfig`` fields; this module holds what it does
with every other key (accepted without effect, accepted at DeepSpeed's
default only, refused with a reason) and the readers of a JSON value: the
package's shared checks, each naming the dotted key in its error.
"""

from __future__ import annotations

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


def as_any(path: str, value: Any) -> Any:
  """Any JSON value (a key whose value zero_jax never reads)."""
  del path
  return value


def as_flag(path: str, value: Any) -> bool:
  """true or false, or those words as strings (as ds_nvme_tune writes)."""
  if isinstance(value, str) and value.strip().lower() in ("true", "false"):
    return value.strip().lower() == "true"
  return check_bool(key_name(path), value, what="true or false")


def as_mapping(path: str, value: Any) -> Mapping[str, Any]:
  if not isinstance(value, Mapping):
    raise ValueError(f"{key_name(path)} must be an object ({{...}}), got "
                     f"{value!r}")
  return value


# Why a key has no effect in zero_jax, by kind (the warning groups keys by
# these, and the docs' key list gives them).
_SCHEDULING = (
    "DeepSpeed's communication scheduling (buckets, overlap, prefetching): "
    "XLA schedules zero_jax's collectives inside the compiled step, and "
    "results do not depend on it")
_LOGGING = (
    "DeepSpeed's console logging: zero_jax prints nothing per step; "
    "Engine.step returns the metrics (loss, grad_norm, learning_rate, ...): "
    "log them with zero_jax.metrics (ProgressBar, JsonlLogger)")
_TIMING = (
    "DeepSpeed's timers: time steps with zero_jax.metrics.Throughput "
    "(step time, tokens/s, MFU), or jax.profiler for a trace")
_MEMORY_LOG = (
    "DeepSpeed's memory printout: zero_jax.estimate_memory gives the "
    "compiled step's bytes per device, jax's device.memory_stats() the "
    "measured ones")
_SAVE16 = (
    "DeepSpeed gathers a 16-bit model file in save_16bit_model: "
    "zero_jax.export_params(engine, state, path) writes the full parameters "
    "whenever it is called")
_RESTORE = (
    "DeepSpeed's checkpoint format: zero_jax's Checkpointer restores the "
    "fp32 master and optimizer state into any device count, stage and "
    "offload")
_NVME_PARAMS = ("an option of parameter offload to NVMe, which zero_jax does "
                "not have (offload_param.device \"nvme\" is refused)")
# DeepSpeed's libaio handle (DeepNVMe): how it submits a request's blocks.
_LIBAIO = ("{what}: zero_jax's I/O threads each submit requests of their own "
           "(NvmeOptions.in_flight of them at once, read from "
           "aio.intra_op_parallelism x aio.queue_depth), and their "
           "completions always overlap")
_PINNED = ("JAX places offloaded state in pinned host memory itself "
           "(memory kind pinned_host)")
_CPU_ADAM = (
    "tunes DeepSpeed's CPU Adam: where zero_jax updates offloaded state is "
    "ZeroConfig.update_on (\"device\" streams it through the device, "
    "\"host\" runs it on the host: the fused host optimizer for the "
    "config's optimizer, on all cores)")
_TORCH_HOOKS = (
    "how DeepSpeed hooks PyTorch modules at stage 3: zero_jax gathers "
    "parameters per layer of scan_layers or per block (zero_jax.layers), "
    "not per module, and has no hooks")
_ANY_TX = ("DeepSpeed's guard for optimizers it did not write: zero_jax "
           "trains with any optax transformation, offloaded or not")
_FP32_ACCUM = ("zero_jax accumulates gradients in float32 whatever the "
               "compute dtype, as this option does")

_SUM_THEN_DIVIDE = ("DeepSpeed's default, which zero_jax does: gradients are "
                    "summed, then divided once")

# Keys accepted without effect, each with a type check and the reason.
# Value: (validator, the only accepted value or ANY, why it has no effect).
NO_EFFECT_KEYS: Mapping[str, tuple[Callable[[str, Any], Any], Any, str]] = {
    "zero_optimization.overlap_comm": (as_bool, ANY, _SCHEDULING),
    "zero_optimization.contiguous_gradients": (as_bool, ANY, _SCHEDULING),
    "zero_optimization.reduce_scatter": (as_bool, ANY, _SCHEDULING),
    "zero_optimization.allgather_partitions": (as_bool, ANY, _SCHEDULING),
    "zero_optimization.reduce_bucket_size": (as_size, ANY, _SCHEDULING),
    "zero_optimization.allgather_bucket_size": (as_size, ANY, _SCHEDULING),
    "zero_optimization.use_multi_rank_bucket_allreduce":
        (as_bool, ANY, _SCHEDULING),
    "zero_optimization.stage3_prefetch_bucket_size":
        (as_size, ANY, _SCHEDULING),
    "zero_optimization.stage3_max_live_parameters":
        (as_size, ANY, _SCHEDULING),
    "zero_optimization.stage3_max_reuse_distance":
        (as_size, ANY, _SCHEDULING),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params":
        (as_bool, ANY, _SCHEDULING),
    "zero_optimization.stage3_allgather_sequential":
        (as_bool, ANY, _SCHEDULING),
    "zero_optimization.stage3_module_granularity_threshold":
        (as_size, ANY, _TORCH_HOOKS),
    "zero_optimization.override_module_apply": (as_bool, ANY, _TORCH_HOOKS),
    "zero_optimization.leaf_module": (
        as_mapping, ANY,
        "names PyTorch modules DeepSpeed fetches whole: zero_jax's unit is "
        "a layer of scan_layers or a block (ZeroConfig.layer_classes names "
        "blocks)"),
    "zero_optimization.sub_group_size": (
        as_size, ANY,
        "tiles DeepSpeed's flat optimizer step: zero_jax updates leaf by "
        "leaf (a slice at a time when offloaded)"),
    "zero_optimization.round_robin_gradients": (
        as_bool, ANY,
        "orders DeepSpeed's gradient copies to the CPU: XLA orders zero_jax's"
        " copies"),
    "zero_optimization.memory_efficient_linear": (
        as_bool, ANY,
        "DeepSpeed's stage 3 linear layer that frees gathered weights "
        "early: zero_jax's gathered parameters are temporaries of the "
        "compiled step, freed after their last use"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save":
        (as_bool, ANY, _SAVE16),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save":
        (as_bool, ANY, _SAVE16),
    "zero_optimization.elastic_checkpoint": (as_bool, ANY, _RESTORE),
    "zero_optimization.load_from_fp32_weights": (
        as_bool, ANY,
        "zero_jax checkpoints hold the fp32 master weights, which a restore "
        "reads"),
    "zero_optimization.pipeline_loading_checkpoint": (
        as_bool, ANY, "checkpoint loading of DeepSpeed's pipeline engine, "
        "which zero_jax does not have"),
    "zero_optimization.log_trace_cache_warnings": (as_bool, ANY, _LOGGING),
    "zero_optimization.enable_sanity_checks": (
        as_bool, ANY, "debug checks of DeepSpeed's stage 3 partitioner: "
        "zero_jax's layout is checked when it is built, every run"),
    "zero_optimization.save_muon_momentum_buffer_in_memory": (
        as_bool, ANY, "keeps DeepSpeed's Muon momentum out of its NVMe swap: "
        "zero_jax's NVMe tier keeps all of the optimizer state in its files "
        "(where state lives does not change results)"),
    "zero_optimization.cpu_offload_use_pin_memory": (as_bool, ANY, _PINNED),
    "zero_optimization.offload_optimizer.pin_memory": (as_bool, ANY, _PINNED),
    "zero_optimization.offload_optimizer.fast_init": (
        as_bool, ANY, "DeepSpeed's faster first write of the optimizer state "
        "to NVMe: zero_jax's init always writes the state files in one "
        "streamed pass"),
    "zero_optimization.offload_optimizer.super_offload":
        (as_bool, ANY, _CPU_ADAM),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": (
        lambda k, v: check_float(key_name(k), v, maximum=1.0), ANY,
        _CPU_ADAM),
    "zero_optimization.offload_param.pin_memory": (as_bool, ANY, _PINNED),
    "zero_optimization.offload_param.nvme_path":
        (as_str, ANY, _NVME_PARAMS),
    "zero_optimization.offload_param.buffer_count":
        (as_size, ANY, _NVME_PARAMS),
    "zero_optimization.offload_param.buffer_size":
        (as_size, ANY, _NVME_PARAMS),
    "zero_optimization.offload_param.max_in_cpu":
        (as_size, ANY, _NVME_PARAMS),
    "activation_checkpointing.number_checkpoints": (
        as_size, ANY, "sizes the buffer of DeepSpeed's partitioned "
        "checkpoints: zero_jax remats every layer of scan_layers, each "
        "keeping its own inputs"),
    "activation_checkpointing.contiguous_memory_optimization": (
        as_bool, ANY, "copies DeepSpeed's checkpoints into one buffer "
        "against fragmentation: XLA assigns the compiled step's buffers "
        "ahead of time, so there is none to avoid"),
    "activation_checkpointing.synchronize_checkpoint_boundary": (
        as_bool, ANY, "synchronizes the GPU at each checkpoint (for "
        "timing): one XLA program runs the whole step, with no host "
        "synchronization between layers"),
    "activation_checkpointing.profile": (as_bool, ANY, _TIMING),
    "bf16.immediate_grad_update": (as_bool, ANY, _FP32_ACCUM),
    "steps_per_print": (as_size, ANY, _LOGGING),
    "wall_clock_breakdown": (as_bool, ANY, _TIMING),
    "memory_breakdown": (as_bool, ANY, _MEMORY_LOG),
    "dump_state": (
        as_bool, ANY, "DeepSpeed prints its config at start: "
        "print(engine.describe()) shows where every parameter lives"),
    "zero_allow_untested_optimizer": (as_bool, ANY, _ANY_TX),
    "zero_force_ds_cpu_optimizer": (as_bool, ANY, _ANY_TX),
    "dataloader_drop_last": (
        as_bool, ANY, "applies to the data loader deepspeed.initialize "
        "builds from training_data: zj.initialize builds none; feed "
        "engine.step batches of engine.train_batch_size"),
    # (DeepNVMe's ds_nvme_tune writes these two as "true"/"false" strings.)
    "aio.single_submit": (as_flag, ANY, _LIBAIO.format(
        what="whether DeepSpeed's libaio handle submits a request's blocks "
        "one by one or in one batch")),
    "aio.overlap_events": (as_flag, ANY, _LIBAIO.format(
        what="whether DeepSpeed's libaio handle submits new blocks before "
        "earlier ones complete")),
    "aio.use_gds": (as_bool, False, "DeepSpeed's default, which zero_jax "
                    "does: the files are read into host RAM"),
    "checkpoint.tag_validation": (
        as_str, ANY, "DeepSpeed checks that all ranks save under one tag: "
        "zero_jax's Checkpointer names checkpoints by step and saves from "
        "every process together"),
    "compile": (
        as_mapping, ANY, "zero_jax's step is always compiled by XLA "
        "(jax.jit), as if enabled"),
    "prescale_gradients": (
        as_bool, ANY, "DeepSpeed divides gradients before its all-reduce "
        "against fp16 overflow: zero_jax sums in reduce_dtype (the "
        "compute dtype unless communication_data_type says otherwise) and "
        "divides once; "
        "the mean is the same"),
    "gradient_predivide_factor": (as_float, 1.0, _SUM_THEN_DIVIDE),
    # DeepSpeedConfig stores this section (runtime/config.py:
    # get_sparse_attention) and its engine never reads it: model code
    # builds deepspeed.ops.sparse_attention's SparseSelfAttention from it.
    "sparse_attention": (
        as_mapping, ANY, "DeepSpeed's engine does not apply this section: "
        "it only configures the SparseSelfAttention modules that model code "
        "builds itself (deepspeed.ops.sparse_attention); a JAX model "
        "implements its own attention, and the section changes nothing in "
        "zero_jax"),
    # Apex AMP's amp.initialize parameters (DeepSpeed passes the section,
    # less "enabled", to it), read only with amp.enabled.
    "amp.verbosity": (as_size, ANY, "Apex's log level"),
    "amp.num_losses": (as_count, 1, "one loss, one scale: Apex's default"),
    "amp.master_weights": (
        as_bool, True, "zero_jax always keeps float32 master weights"),
    "amp.max_loss_scale": (
        as_float, 2.0**24, "Apex's default cap on the dynamic scale"),
}

# No-effect keys accepted without a warning: options of an offload that
# does happen (or of parameter offload to NVMe, which is an error by
# itself).
QUIET: frozenset[str] = frozenset(
    k for k in NO_EFFECT_KEYS if k.startswith((
        "zero_optimization.offload_optimizer.",
        "zero_optimization.offload_param.")) and not k.endswith((
            ".super_offload", ".cpuadam_cores_perc")))

_NOT_IMPLEMENTED = "a DeepSpeed feature that zero_jax does not implement"
_ZERO_PP = ("this part of ZeRO++ is not implemented in zero_jax (its "
            "quantized weights and gradients and hpZ are: "
            "zero_quantized_weights, zero_quantized_gradients, "
            "zero_hpz_partition_size)")
_MONITOR = ("zero_jax does not write {what} logs: log the metrics that "
            "Engine.step returns with zero_jax.metrics.JsonlLogger (e.g. "
            "log.log(step, **metrics)), then set {key}.enabled to false")
_PREDIVIDE = (
    "zero_jax sums gradients in reduce_dtype (the compute dtype unless "
    "communication_data_type says otherwise) and divides once; "
    "pre-division is not implemented")
_APEX_CASTS = (
    "Apex's per-module or per-function casts of a PyTorch model: zero_jax "
    "casts every parameter to compute_dtype (amp O1 and O2 read as "
    "float16); remove the key, or write null")
_OWN_CHECKPOINTS = ("zero_jax's Checkpointer (orbax) writes checkpoints; "
                    "remove this section")
_OPTIMIZER = (
    "from_deepspeed builds no optimizer: use zj.initialize(loss_fn, params, "
    "config), which builds the optax transformation from this section, or "
    "build it with zero_jax.config.optimizer_from_deepspeed("
    "config['optimizer'], config.get('scheduler')) (or with optax) and pass "
    "it to Engine as tx")

# Keys DeepSpeed knows that zero_jax does not honour, with why and what to do.
UNSUPPORTED_WHY: Mapping[str, str] = {
    "optimizer": _OPTIMIZER,
    "scheduler": _OPTIMIZER,
    "amp.opt_level": (
        "Apex's O3 trains float16 weights without float32 master weights, "
        "which zero_jax does not do: write \"O2\" (float32 master weights, "
        "float16 compute, as fp16.enabled), or set fp16.enabled to true and "
        "amp.enabled to false"),
    "amp.num_losses": (
        "zero_jax scales one loss: write 1, or leave the key out"),
    "amp.master_weights": (
        "zero_jax always keeps float32 master weights: write true, or leave "
        "the key out"),
    "amp.max_loss_scale": (
        "zero_jax's dynamic scale has no cap but Apex's default 2**24: "
        "leave the key out"),
    "amp.cast_model_type": _APEX_CASTS,
    "amp.patch_torch_functions": _APEX_CASTS,
    "amp.keep_batchnorm_fp32": _APEX_CASTS,
    "amp.cast_model_outputs": _APEX_CASTS,
    "torch_autocast": (
        "zero_jax casts the parameters to ZeroConfig.compute_dtype, not per "
        "operation: set bf16.enabled (or fp16.enabled) instead, and "
        "torch_autocast.enabled to false"),
    "tensorboard": _MONITOR.format(what="TensorBoard", key="tensorboard"),
    "wandb": _MONITOR.format(what="Weights & Biases", key="wandb"),
    "csv_monitor": _MONITOR.format(what="CSV", key="csv_monitor"),
    "comet": _MONITOR.format(what="Comet", key="comet"),
    "comms_logger": (
        "zero_jax does not log collectives as they run: they are in the "
        "compiled step (zero_jax.estimate_comm counts their bytes; "
        "engine.step.lower(state, batch).compile().as_text() lists them); "
        "set comms_logger.enabled to false"),
    "flops_profiler": (
        "use jax.profiler, or cost_analysis() of the lowered step "
        "(engine.step.lower(state, batch).compile()); set "
        "flops_profiler.enabled to false"),
    "pipeline": "pipeline parallelism is not implemented in zero_jax",
    "moe": "mixture-of-experts parallelism is not implemented in zero_jax",
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
    "nebula": _OWN_CHECKPOINTS,
    "checkpoint": _OWN_CHECKPOINTS,
    "disable_allgather": _NOT_IMPLEMENTED,
    "gradient_predivide_factor": _PREDIVIDE,
    "aio.use_gds": (
        "GPUDirect Storage reads files straight into GPU memory: zero_jax "
        "reads the NVMe tier's files into host RAM, where the host update "
        "runs (update_on=\"host\"); write false (without NVMe offload the "
        "aio section has no effect, true included)"),
    "fp16.auto_cast": (
        "zero_jax casts the parameters, not the batch: cast floating inputs "
        "to float16 inside loss_fn, and set fp16.auto_cast to false"),
    "fp16.fp16_master_weights_and_grads": (
        "master weights and gradients stay float32 in zero_jax"),
    "bf16.bf16_master_weights_and_grads": (
        "master weights and gradients stay float32 in zero_jax"),
    "bf16.bf16_optimizer_states": (
        "optimizer state stays float32 in zero_jax"),
    "data_types.grad_accum_dtype": (
        "zero_jax accumulates gradients in float32; write \"fp32\""),
    "zero_optimization.stage3_model_persistence_threshold": (
        "zero_jax has no cap on the total size of replicated parameters: "
        "stage3_param_persistence_threshold (min_shard_elements) alone "
        "decides; Engine.describe() lists every replicated leaf"),
    "zero_optimization.zero_quantized_nontrainable_weights": _ZERO_PP,
    "zero_optimization.zeropp_loco_param": _ZERO_PP,
    "zero_optimization.mics_shard_size": (
        "MiCS is not implemented as such: make_mesh(replica=R) shards the "
        "state inside groups of devices // R and replicates it across them"),
    "zero_optimization.mics_hierarchical_params_gather": _NOT_IMPLEMENTED,
    "zero_optimization.ignore_unused_parameters": (
        "zero_jax gives unused parameters zero gradients and never checks "
        "for them (DeepSpeed's default, true)"),
    "zero_optimization.legacy_stage1": _NOT_IMPLEMENTED,
    "zero_optimization.zenflow": _NOT_IMPLEMENTED,
}

# Keys that are harmless at DeepSpeed's default (writing the default out is
# common); any other value is unsupported, for the reason above.
DEFAULT_ONLY: Mapping[str, Any] = {
    "fp16.auto_cast": False,
    "fp16.fp16_master_weights_and_grads": False,
    "bf16.bf16_master_weights_and_grads": False,
    "bf16.bf16_optimizer_states": False,
    "zero_optimization.zero_quantized_nontrainable_weights": False,
    "zero_optimization.mics_shard_size": -1,
    "zero_optimization.mics_hierarchical_params_gather": False,
    "zero_optimization.ignore_unused_parameters": True,
    "zero_optimization.legacy_stage1": False,
    "zero_optimization.stage3_model_persistence_threshold": sys.maxsize,
    "sparse_gradients": False,
    "disable_allgather": False,
}

# Sections with an "enabled" switch (absent: DeepSpeed's default, false):
# accepted when off, whatever else they hold (DeepSpeed reads none of it
# then); when on, unsupported for the reason in UNSUPPORTED_WHY.
# (amp is read by the translator itself: enabled, it maps to float16.)
SWITCHED: tuple[str, ...] = (
    "torch_autocast", "tensorboard", "wandb", "csv_monitor", "comet",
    "comms_logger", "flops_profiler", "nebula", "elasticity", "autotuning",
    "eigenvalue", "progressive_layer_drop", "hybrid_engine",
    "data_efficiency", "curriculum_learning")

# DeepSpeed's pydantic models accept a field's name and its alias; the
# tables above use the alias (what DeepSpeed's docs write). Field name ->
# alias, dotted.
ALIASES: Mapping[str, str] = {
    "zero_optimization.prefetch_bucket_size":
        "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.param_persistence_threshold":
        "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.model_persistence_threshold":
        "zero_optimization.stage3_model_persistence_threshold",
    "zero_optimization.max_live_parameters":
        "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.max_reuse_distance":
        "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.gather_16bit_weights_on_model_save":
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.module_granularity_threshold":
        "zero_optimization.stage3_module_granularity_threshold",
    "zero_optimization.use_all_reduce_for_fetch_params":
        "zero_optimization.stage3_use_all_reduce_for_fetch_params",
    "zero_optimization.allgather_sequential":
        "zero_optimization.stage3_allgather_sequential",
}

# Keys that real configs write but DeepSpeed does not read (its config
# reader ignores unknown keys): accepted with a warning that names the key
# DeepSpeed reads instead. Only these: any other unknown key stays an error
# (most likely a typo). Value: what DeepSpeed reads instead.
NOT_READ_BY_DEEPSPEED: Mapping[str, str] = {
    # deepspeed/monitor/config.py, get_monitor_config: the monitors are the
    # top-level sections; DeepSpeedConfig.monitor_config is an attribute.
    "monitor_config": "the top-level sections tensorboard, wandb, "
                      "csv_monitor and comet",
    # deepspeed/comm/config.py, DeepSpeedCommsConfig: reads comms_logger;
    # DeepSpeedConfig.comms_config is an attribute.
    "comms_config": "the top-level section comms_logger",
    # No "log" section in deepspeed/runtime/config.py: logging every N
    # steps is the top-level steps_per_print.
    "log": "the top-level key steps_per_print",
}

UNKNOWN = ("not a DeepSpeed key that zero_jax knows (check the spelling "
           "against DeepSpeed's config documentation)")

DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16",
          "float16": "float16", "half": "float16", "bf16": "bfloat16",
          "bfloat16": "bfloat16"}


def warn(message: str) -> None:
  """Warns at the first frame outside zero_jax (the user's call)."""
  # (The package's directory, not this subpackage's: zero_jax.initialize
  # and the config's other callers are zero_jax's too.)
  package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  level, frame = 1, sys._getframe(0)  # pylint: disable=protected-access
  while frame is not None and os.path.abspath(
      frame.f_code.co_filename).startswith(package + os.sep):
    frame, level = frame.f_back, level + 1
  warnings.warn(message, UserWarning, stacklevel=level)


def is_auto(value: Any) -> bool:
  return isinstance(value, str) and value.strip().lower() == "auto"

