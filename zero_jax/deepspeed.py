"""Reads a DeepSpeed JSON config into a ``ZeroConfig``.

``from_deepspeed(path_or_dict)`` translates the parts of a DeepSpeed config
that zero_jax implements and refuses the rest by name, so that a config
written for DeepSpeed either means the same thing here or fails loudly::

  cfg = zero_jax.ZeroConfig.from_deepspeed("ds_config.json")
  engine = zero_jax.Engine(loss_fn, optax.adamw(3e-4), cfg, mesh)

Keys understood (an absent key takes ZeroConfig's default, which is
DeepSpeed's except where noted; a JSON ``null`` counts as absent)::

  DeepSpeed key                           ZeroConfig field
  --------------------------------------  ---------------------------
  train_batch_size                        train_batch_size
  train_micro_batch_size_per_gpu          micro_batch_size
  gradient_accumulation_steps             grad_accum_steps
  gradient_clipping (0: none)             clip_grad_norm
  fp16.enabled                            compute_dtype="float16"
  fp16.loss_scale (0: dynamic)            loss_scale
  fp16.initial_scale_power                initial_scale_power
  fp16.loss_scale_window                  loss_scale_window
  fp16.hysteresis                         hysteresis
  fp16.min_loss_scale                     min_loss_scale
  fp16.consecutive_hysteresis             consecutive_hysteresis
  bf16.enabled (old alias: bfloat16)      compute_dtype="bfloat16"
  communication_data_type                 reduce_dtype
    ("fp32", "fp16", "bf16")
  data_types.grad_accum_dtype ("fp32")    (always float32)
  zero_optimization (absent, false: 0)
    .stage                                stage
    .stage3_param_persistence_threshold   min_shard_elements (+ 1)
    .offload_optimizer.device             offload_optimizer
    .offload_param.device                 offload_params
      ("cpu": "host", "none": None)

Notes on the mapping:

* The batch sizes are copied, not resolved: ``ZeroConfig.batch_sizes`` applies
  DeepSpeed's ``train = micro x accum x devices`` rule once the device count
  is known.
* The fp16 keys other than ``enabled`` are read only when fp16 is enabled
  (DeepSpeed ignores them too); ``fp16.auto_cast`` may only be false.
* ``communication_data_type`` absent: gradients are summed in float32
  (zero_jax's default), where DeepSpeed sums in the compute dtype; write
  ``"fp16"`` or ``"bf16"`` to match DeepSpeed's bytes.
* DeepSpeed keeps a parameter whole when it has *at most*
  ``stage3_param_persistence_threshold`` elements; zero_jax when it has
  *fewer than* ``min_shard_elements``, so the field is the threshold + 1.
  Absent, zero_jax's default (1024) applies, not DeepSpeed's (1e5).
* ``offload_optimizer.device``: ``"cpu"`` gives ``"host"`` and ``"none"``
  gives None; ``"nvme"`` is always an error (zero_jax has no disk offload).
  ``pin_memory``, ``buffer_count``, ``fast_init``, ``pipeline_read``,
  ``pipeline_write`` and ``nvme_path`` are accepted and have no effect (JAX
  pins host memory itself); ``ratio`` below 1 warns, as all of the state is
  offloaded. ``offload_param.device``: ``"cpu"`` gives
  ``offload_params="host"`` (stage 3 only), ``"nvme"`` is an error.
* The performance knobs in ``_NO_EFFECT_KEYS`` (bucket sizes, overlap,
  prefetching, printing...) are accepted with one warning listing them: XLA
  schedules zero_jax's communication, so they change nothing.
* Everything else (``optimizer``, ``scheduler``, ``activation_checkpointing``,
  ``amp``, monitoring, ``pipeline``, ``moe``, unknown keys...) is refused with
  a ``ValueError`` naming the dotted key and what to do instead; with
  ``unsupported="warn"`` each becomes a ``UserWarning`` and is dropped. Build
  the optimizer and its schedule with optax and pass it to ``Engine``.
* HuggingFace's ``"auto"`` placeholder is an error wherever it is read:
  the Trainer fills those in, zero_jax does not.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any, Callable, Mapping
import warnings

from zero_jax.config import ZeroConfig

_MODES = ("error", "warn")
_ANY = object()  # a key of _NO_EFFECT_KEYS that accepts any valid value


def _bool(path: str, value: Any) -> bool:
  if not isinstance(value, bool):
    raise ValueError(f"DeepSpeed config key {path!r} must be true or false, "
                     f"got {value!r}")
  return value


def _int(path: str, value: Any, *, minimum: int,
         allow_float: bool = False) -> int:
  """An integer >= minimum; integral floats too where JSON writes 5e8."""
  if (allow_float and isinstance(value, float) and value.is_integer()):
    value = int(value)
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise ValueError(f"DeepSpeed config key {path!r} must be an integer >= "
                     f"{minimum}, got {value!r}")
  return value


def _number(path: str, value: Any, *, minimum: float,
            strict: bool = False) -> float:
  """A number >= minimum (> minimum when strict)."""
  if (isinstance(value, bool) or not isinstance(value, (int, float))
      or value != value or value < minimum or (strict and value == minimum)):
    raise ValueError(f"DeepSpeed config key {path!r} must be a number "
                     f"{'>' if strict else '>='} {minimum}, got {value!r}")
  return value


def _size(path: str, value: Any) -> int:
  return _int(path, value, minimum=0, allow_float=True)


def _count(path: str, value: Any) -> int:
  return _int(path, value, minimum=1)


def _float(path: str, value: Any) -> float:
  return _number(path, value, minimum=0.0, strict=True)


def _str(path: str, value: Any) -> str:
  if not isinstance(value, str):
    raise ValueError(f"DeepSpeed config key {path!r} must be a string, got "
                     f"{value!r}")
  return value


# Keys that change only how DeepSpeed schedules its communication, or what
# it prints: XLA's scheduler decides that for zero_jax, and results do not
# depend on them. Accepted (with a type check) and reported in one warning.
# Value: (validator, the only accepted value or _ANY).
_NO_EFFECT_KEYS: Mapping[str, tuple[Callable[[str, Any], Any], Any]] = {
    "zero_optimization.overlap_comm": (_bool, _ANY),
    "zero_optimization.contiguous_gradients": (_bool, _ANY),
    "zero_optimization.reduce_scatter": (_bool, _ANY),
    "zero_optimization.allgather_partitions": (_bool, _ANY),
    "zero_optimization.reduce_bucket_size": (_size, _ANY),
    "zero_optimization.allgather_bucket_size": (_size, _ANY),
    "zero_optimization.use_multi_rank_bucket_allreduce": (_bool, _ANY),
    "zero_optimization.stage3_prefetch_bucket_size": (_size, _ANY),
    "zero_optimization.stage3_max_live_parameters": (_size, _ANY),
    "zero_optimization.stage3_max_reuse_distance": (_size, _ANY),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": (_bool, _ANY),
    "zero_optimization.stage3_module_granularity_threshold": (_size, _ANY),
    "zero_optimization.sub_group_size": (_size, _ANY),
    "zero_optimization.round_robin_gradients": (_bool, _ANY),
    "zero_optimization.memory_efficient_linear": (_bool, _ANY),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save":
        (_bool, _ANY),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save":
        (_bool, _ANY),
    "zero_optimization.elastic_checkpoint": (_bool, _ANY),
    "zero_optimization.load_from_fp32_weights": (_bool, _ANY),
    "steps_per_print": (_size, _ANY),
    "wall_clock_breakdown": (_bool, _ANY),
    "zero_allow_untested_optimizer": (_bool, _ANY),
    "zero_force_ds_cpu_optimizer": (_bool, _ANY),
    "dump_state": (_bool, _ANY),
    "prescale_gradients": (_bool, False),
    "gradient_predivide_factor": (_float, 1.0),
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
_UNSUPPORTED_WHY: Mapping[str, str] = {
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
_DEFAULT_ONLY: Mapping[str, Any] = {
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

_UNKNOWN = ("not a DeepSpeed key that zero_jax knows (check the spelling "
            "against DeepSpeed's config documentation)")

_DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16",
           "float16": "float16", "half": "float16", "bf16": "bfloat16",
           "bfloat16": "bfloat16"}

# ZeroConfig field -> the DeepSpeed key it came from, for ZeroConfig's errors.
_FIELD_SOURCES = {
    "train_batch_size": "train_batch_size",
    "micro_batch_size": "train_micro_batch_size_per_gpu",
    "grad_accum_steps": "gradient_accumulation_steps",
    "clip_grad_norm": "gradient_clipping",
    "loss_scale": "fp16.loss_scale",
    "initial_scale_power": "fp16.initial_scale_power",
    "loss_scale_window": "fp16.loss_scale_window",
    "hysteresis": "fp16.hysteresis",
    "min_loss_scale": "fp16.min_loss_scale",
    "reduce_dtype": "communication_data_type",
    "min_shard_elements":
        "zero_optimization.stage3_param_persistence_threshold",
}


def _load(config: Any) -> tuple[Mapping[str, Any], str | None]:
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


def _warn(message: str) -> None:
  """Warns at the first frame outside zero_jax (the user's call)."""
  package = os.path.dirname(os.path.abspath(__file__))
  level, frame = 1, sys._getframe(0)  # pylint: disable=protected-access
  while frame is not None and os.path.abspath(
      frame.f_code.co_filename).startswith(package + os.sep):
    frame, level = frame.f_back, level + 1
  warnings.warn(message, UserWarning, stacklevel=level)


def _is_auto(value: Any) -> bool:
  return isinstance(value, str) and value.strip().lower() == "auto"


class _Translator:
  """Walks a DeepSpeed config, collecting ZeroConfig kwargs and problems."""

  def __init__(self, unsupported: str):
    self.mode = unsupported
    self.kwargs: dict[str, Any] = {}
    self.problems: list[tuple[str, str]] = []  # (dotted key, why)
    self.notes: list[str] = []  # warnings about accepted keys
    self.no_effect: list[str] = []

  # Reading one key.

  def get(self, section: Mapping[str, Any], key: str, prefix: str) -> Any:
    """The value of ``key`` (None when absent or null); rejects "auto"."""
    value = section.get(key)
    if _is_auto(value):
      raise ValueError(
          f"DeepSpeed config key {prefix + key!r} is \"auto\": replace 'auto' "
          "with a number (or true/false): HuggingFace Trainer fills these "
          "in, zero_jax does not")
    return value

  def section(self, parent: Mapping[str, Any], key: str,
              prefix: str) -> Mapping[str, Any]:
    value = self.get(parent, key, prefix)
    if value is None:
      return {}
    if not isinstance(value, Mapping):
      raise ValueError(f"DeepSpeed config key {prefix + key!r} must be an "
                       f"object ({{...}}), got {value!r}")
    return value

  def unsupported(self, path: str) -> None:
    self.problems.append((path, _UNSUPPORTED_WHY.get(path, _UNKNOWN)))

  def rest(self, section: Mapping[str, Any], prefix: str,
           handled: set[str]) -> None:
    """Sorts the keys not in ``handled``: no-effect, default, unsupported."""
    for key in section:
      if key in handled:
        continue
      path = f"{prefix}{key}"
      if path in _NO_EFFECT_KEYS:
        value = self.get(section, key, prefix)
        if value is None:
          continue
        check, only = _NO_EFFECT_KEYS[path]
        value = check(path, value)
        if only is _ANY or value == only:
          self.no_effect.append(path)
        else:
          self.unsupported(path)
      elif path in _DEFAULT_ONLY:
        value = section[key]
        if value is not None and (type(value) is not type(_DEFAULT_ONLY[path])
                                  or value != _DEFAULT_ONLY[path]):
          self.unsupported(path)
      else:
        self.unsupported(path)

  # Sections.

  def top(self, config: Mapping[str, Any]) -> None:
    handled = {"train_batch_size", "train_micro_batch_size_per_gpu",
               "gradient_accumulation_steps", "gradient_clipping", "fp16",
               "bf16", "bfloat16", "communication_data_type", "data_types",
               "zero_optimization"}
    for key, field in (("train_batch_size", "train_batch_size"),
                       ("train_micro_batch_size_per_gpu", "micro_batch_size"),
                       ("gradient_accumulation_steps", "grad_accum_steps")):
      value = self.get(config, key, "")
      if value is not None:
        self.kwargs[field] = _count(key, value)
    clip = self.get(config, "gradient_clipping", "")
    if clip is not None:
      clip = _number("gradient_clipping", clip, minimum=0.0)
      self.kwargs["clip_grad_norm"] = float(clip) if clip > 0 else None
    self.precision(config)
    comm = self.get(config, "communication_data_type", "")
    if comm is not None:
      name = _str("communication_data_type", comm).strip().lower()
      if name not in _DTYPES:
        raise ValueError(
            "DeepSpeed config key 'communication_data_type' must be one of "
            f"{sorted(set(_DTYPES))}, got {comm!r}")
      self.kwargs["reduce_dtype"] = _DTYPES[name]
    self.data_types(self.section(config, "data_types", ""))
    self.zero(config)
    self.rest(config, "", handled)

  def precision(self, config: Mapping[str, Any]) -> None:
    fp16 = self.section(config, "fp16", "")
    fp16_on = fp16.get("enabled") is not None and _bool(
        "fp16.enabled", self.get(fp16, "enabled", "fp16."))
    if "bf16" in config and "bfloat16" in config:
      raise ValueError("the DeepSpeed config has both 'bf16' and its old "
                       "alias 'bfloat16'; keep only 'bf16'")
    bf16_key = "bfloat16" if "bfloat16" in config else "bf16"
    bf16 = self.section(config, bf16_key, "")
    bf16_on = bf16.get("enabled") is not None and _bool(
        f"{bf16_key}.enabled", self.get(bf16, "enabled", f"{bf16_key}."))
    if fp16_on and bf16_on:
      raise ValueError(
          f"the DeepSpeed config enables both fp16 and {bf16_key}; enable "
          "one (bf16 needs no loss scaling)")
    self.rest(bf16, f"{bf16_key}.", {"enabled"})
    fp16_keys = {"loss_scale", "initial_scale_power", "loss_scale_window",
                 "hysteresis", "min_loss_scale", "consecutive_hysteresis"}
    if bf16_on:
      self.kwargs["compute_dtype"] = "bfloat16"
    if not fp16_on:
      # DeepSpeed ignores the other fp16 keys when fp16 is off; so do we
      # (but still flags keys it does not know, most likely typos).
      known = fp16_keys | {"enabled"} | {
          k.split(".", 1)[1] for k in _UNSUPPORTED_WHY if
          k.startswith("fp16.")}
      self.rest(fp16, "fp16.", known)
      return
    self.kwargs["compute_dtype"] = "float16"
    p = "fp16."
    value = self.get(fp16, "loss_scale", p)
    if value is not None:
      self.kwargs["loss_scale"] = float(
          _number(p + "loss_scale", value, minimum=0.0))
    value = self.get(fp16, "initial_scale_power", p)
    if value is not None:
      self.kwargs["initial_scale_power"] = _int(
          p + "initial_scale_power", value, minimum=0)
    for key in ("loss_scale_window", "hysteresis"):
      value = self.get(fp16, key, p)
      if value is not None:
        self.kwargs[key] = _count(p + key, value)
    value = self.get(fp16, "min_loss_scale", p)
    if value is not None:
      self.kwargs["min_loss_scale"] = float(
          _float(p + "min_loss_scale", value))
    value = self.get(fp16, "consecutive_hysteresis", p)
    if value is not None:
      self.kwargs["consecutive_hysteresis"] = _bool(
          p + "consecutive_hysteresis", value)
    value = self.get(fp16, "auto_cast", p)
    if value is not None:
      _bool(p + "auto_cast", value)
    self.rest(fp16, p, fp16_keys | {"enabled"})

  def data_types(self, section: Mapping[str, Any]) -> None:
    value = self.get(section, "grad_accum_dtype", "data_types.")
    if value is not None:
      name = _str("data_types.grad_accum_dtype", value).strip().lower()
      if _DTYPES.get(name) != "float32":
        self.unsupported("data_types.grad_accum_dtype")
    self.rest(section, "data_types.", {"grad_accum_dtype"})

  def zero(self, config: Mapping[str, Any]) -> None:
    zero = self.get(config, "zero_optimization", "")
    if zero is None or zero is False:
      self.kwargs["stage"] = 0
      return
    if zero is True:
      self.notes.append(
          "'zero_optimization': true is DeepSpeed's deprecated form of "
          "{\"stage\": 1}; read as stage 1")
      self.kwargs["stage"] = 1
      return
    zero = self.section(config, "zero_optimization", "")
    p = "zero_optimization."
    stage = self.get(zero, "stage", p)
    stage = 0 if stage is None else _int(p + "stage", stage, minimum=0)
    if stage > 3:
      raise ValueError(f"DeepSpeed config key 'zero_optimization.stage' must "
                       f"be 0, 1, 2 or 3, got {stage}")
    self.kwargs["stage"] = stage
    value = self.get(zero, "stage3_param_persistence_threshold", p)
    if value is not None:
      # DeepSpeed keeps leaves with <= threshold elements whole; zero_jax
      # those with < min_shard_elements.
      self.kwargs["min_shard_elements"] = _size(
          p + "stage3_param_persistence_threshold", value) + 1
    self.offload_optimizer(self.section(zero, "offload_optimizer", p))
    self.offload_param(self.section(zero, "offload_param", p))
    self.rest(zero, p, {"stage", "stage3_param_persistence_threshold",
                        "offload_optimizer", "offload_param"})

  def offload_device(self, section: Mapping[str, Any], p: str, field: str,
                     what: str) -> str:
    """Reads ``device`` ("none" or "cpu"; "nvme" is always an error) and
    sets ``field`` to "host" for "cpu"."""
    device = self.get(section, "device", p)
    device = "none" if device is None else _str(
        p + "device", device).strip().lower()
    if device == "nvme":
      raise ValueError(
          f"DeepSpeed config key '{p}device' is \"nvme\": disk (NVMe) "
          f"offload does not exist in zero_jax; use \"cpu\" to keep the "
          f"{what} in host memory")
    if device not in ("none", "cpu"):
      raise ValueError(f"DeepSpeed config key '{p}device' must be \"cpu\" "
                       f"or \"none\", got {device!r}")
    if device == "cpu":
      self.kwargs[field] = "host"
    return device

  def offload_optimizer(self, section: Mapping[str, Any]) -> None:
    p = "zero_optimization.offload_optimizer."
    device = self.offload_device(section, p, "offload_optimizer",
                                 "optimizer state")
    checks = {"pin_memory": _bool, "fast_init": _bool, "pipeline_read": _bool,
              "pipeline_write": _bool, "buffer_count": _size,
              "nvme_path": _str}
    for key, check in checks.items():
      value = self.get(section, key, p)
      if value is not None:
        check(p + key, value)
    ratio = self.get(section, "ratio", p)
    if ratio is not None:
      ratio = _number(p + "ratio", ratio, minimum=0.0)
      if ratio > 1:
        raise ValueError(f"DeepSpeed config key '{p}ratio' must be in [0, 1]"
                         f", got {ratio!r}")
      if ratio < 1 and device == "cpu":
        self.notes.append(
            f"'{p}ratio' is {ratio}: zero_jax offloads all of the optimizer "
            "state, not a fraction of it")
    self.rest(section, p, {"device", "ratio", *checks})

  def offload_param(self, section: Mapping[str, Any]) -> None:
    p = "zero_optimization.offload_param."
    self.offload_device(section, p, "offload_params", "parameters")
    self.rest(section, p, {"device", "nvme_path", "pin_memory", "buffer_count",
                           "buffer_size", "max_in_cpu"})

  # Outcome.

  def finish(self, source: str) -> None:
    """Raises for the problems (mode "error"), or warns about them."""
    if self.problems and self.mode == "error":
      lines = "\n".join(f"  {path}: {why}" for path, why in self.problems)
      many = len(self.problems) > 1
      raise ValueError(
          f"DeepSpeed config{source} has {len(self.problems)} key"
          f"{'s' if many else ''} that zero_jax does not support:\n{lines}\n"
          f"Remove {'them' if many else 'it'}, or pass unsupported='warn' to "
          f"drop {'them' if many else 'it'} with a warning.")
    for path, why in self.problems:
      _warn(f"DeepSpeed config key {path!r} is not supported by zero_jax and "
            f"was dropped: {why}")
    for note in self.notes:
      _warn(f"DeepSpeed config{source}: {note}")
    if self.no_effect:
      _warn(
          f"DeepSpeed config{source}: {', '.join(self.no_effect)} ha"
          f"{'ve' if len(self.no_effect) > 1 else 's'} no effect in zero_jax: "
          "XLA schedules its communication (bucketing, overlap, "
          "prefetching) and results do not depend on these settings; remove "
          "them to silence this warning")


def from_deepspeed(config: str | os.PathLike | Mapping[str, Any], *,
                   unsupported: str = "error") -> ZeroConfig:
  """Translates a DeepSpeed JSON config into a ``ZeroConfig``.

  See the module docstring for the keys understood and how they map.

  Args:
    config: path to a DeepSpeed JSON file, or the already-parsed dict.
    unsupported: ``"error"`` (default) raises on keys that are unknown, or
      known to DeepSpeed but not honoured by zero_jax; ``"warn"`` issues one
      ``UserWarning`` per such key and drops it.

  Returns:
    The config. Batch sizes are copied as given; ``ZeroConfig.batch_sizes``
    resolves them once the device count is known.

  Raises:
    ValueError: a value has the wrong type or is ``"auto"``, fp16 and bf16
      are both enabled, optimizer offload to NVMe is asked for, the file is
      not valid JSON, or (with ``unsupported="error"``) a key is not
      supported; the message names the dotted key.
    FileNotFoundError: ``config`` is a path that does not exist.
    TypeError: ``config`` is neither a path nor a mapping.
  """
  if unsupported not in _MODES:
    raise ValueError(f"unsupported must be one of {_MODES}, got "
                     f"{unsupported!r}")
  data, path = _load(config)
  source = f" {path!r}" if path is not None else ""
  translator = _Translator(unsupported)
  try:
    translator.top(data)
  except ValueError as e:
    if path is None:
      raise
    raise ValueError(f"{e} (in {path!r})") from None
  translator.finish(source)
  kwargs = translator.kwargs
  try:
    return ZeroConfig(**kwargs)
  except ValueError as e:
    sources = [f"{field} is {key!r}" for field, key in _FIELD_SOURCES.items()
               if field in kwargs and re.search(rf"\b{field}\b", str(e))]
    raise ValueError(
        f"DeepSpeed config{source} gives an invalid ZeroConfig: {e}" +
        (f" (in DeepSpeed's terms: {'; '.join(sources)})" if sources else "")
    ) from None
