"""The DeepSpeed to ``ZeroConfig`` key map (``MAPPING``) and the Markdown
tables rendered from it and from the key tables of ``_ds_keys``.

``from_deepspeed`` translates by ``MAPPING``; ``mapping_table_markdown`` and
``key_list_markdown`` render what it does for the docs, so docs made from
them say what the code does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from zero_jax._checks import check_choice, fail
from zero_jax.config._config import SHORTHAND, STAGES
from zero_jax.config._ds_keys import (ALIASES, ANY, DEFAULT_ONLY, DTYPES,
                                     NO_EFFECT_KEYS, NOT_READ_BY_DEEPSPEED,
                                     SWITCHED,
                                     UNSUPPORTED_WHY, as_bool, as_count,
                                     as_float, as_int, as_number, as_size,
                                     as_str, key_name)


@dataclasses.dataclass(frozen=True)
class DeepSpeedKey:
  """One row of the DeepSpeed to ZeroConfig map.

  Attributes:
    key: the dotted DeepSpeed key.
    field: the ``ZeroConfig`` field it sets ("" for none; ``"nvme.x"`` for
      field ``x`` of ``ZeroConfig.nvme``, an ``NvmeOptions``).
    read: ``(key, value) -> field value`` for a present, non-null value:
      checks it (the error names the key) and converts it. None where the
      translator reads the key itself (a switch, an offload device). The
      NVMe rows are applied with ``offload_optimizer.device`` "nvme" only
      (``_ds_nvme``).
    note: how the value maps, for the docs ("" when it is copied).
  """

  key: str
  field: str
  read: Callable[[str, Any], Any] | None = None
  note: str = ""

  @property
  def prefix(self) -> str:
    """The key's section, dotted, with a trailing dot ("" at the top)."""
    section = self.key.rpartition(".")[0]
    return section + "." if section else ""

  @property
  def leaf(self) -> str:
    """The key's last part, its name in its section."""
    return self.key.rpartition(".")[2]



def _clip(key: str, value: Any) -> float | None:
  value = as_number(key, value, minimum=0.0)
  return value if value > 0 else None


def _reduce_dtype(key: str, value: Any) -> str:
  name = as_str(key, value).strip().lower()
  if name not in DTYPES:
    fail(key_name(key), f"one of {sorted(DTYPES)}", value)
  return DTYPES[name]


def _stage(key: str, value: Any) -> int:
  return check_choice(key_name(key), value, STAGES)


def _positive(key: str, value: Any) -> int:
  return as_count(key, as_size(key, value))


def _persistence(key: str, value: Any) -> int:
  # DeepSpeed keeps leaves with <= threshold elements whole; zero_jax
  # those with < min_shard_elements.
  return as_size(key, value) + 1


_FP16 = "read only with fp16.enabled"
_DEVICE = "\"cpu\": \"host\", \"none\": None"
_ON_NVME = "with offload_optimizer.device \"nvme\" (otherwise no effect)"
_THREADS = ("intra_op_parallelism x queue_depth, the requests in flight, each "
            "from an I/O thread of its own (the one absent: DeepSpeed's "
            "default, queue_depth 8, intra_op_parallelism 1; both absent: "
            "zero_jax's 8); " + _ON_NVME)
_ALIAS = "two of these names with different values: an error; " + _ON_NVME
_BUILT = ("zj.initialize builds the optax transformation from it "
          "(zero_jax.config.optimizer_from_deepspeed); from_deepspeed "
          "refuses it")

# The DeepSpeed keys zero_jax translates, in the order it reads them.
MAPPING: tuple[DeepSpeedKey, ...] = (
    DeepSpeedKey("train_batch_size", "train_batch_size", as_count),
    DeepSpeedKey("train_micro_batch_size_per_gpu", "micro_batch_size",
                 as_count),
    DeepSpeedKey("gradient_accumulation_steps", "grad_accum_steps",
                 as_count),
    DeepSpeedKey("gradient_clipping", "clip_grad_norm", _clip, "0: none"),
    DeepSpeedKey("communication_data_type", "reduce_dtype", _reduce_dtype,
                 "\"fp32\", \"fp16\", \"bf16\" (absent: the compute dtype; "
                 "float32 with loss_scope=\"per_device\")"),
    DeepSpeedKey("optimizer", "", None, _BUILT),
    DeepSpeedKey("scheduler", "", None,
                 _BUILT.replace("the optax transformation",
                                "the learning-rate schedule")),
    DeepSpeedKey("fp16.enabled", "compute_dtype", None, "true: \"float16\""),
    DeepSpeedKey("fp16.loss_scale", "loss_scale",
                 lambda k, v: as_number(k, v, minimum=0.0),
                 f"0: dynamic; {_FP16}"),
    DeepSpeedKey("fp16.initial_scale_power", "initial_scale_power",
                 lambda k, v: as_int(k, v, minimum=0), _FP16),
    DeepSpeedKey("fp16.loss_scale_window", "loss_scale_window", as_count,
                 _FP16),
    DeepSpeedKey("fp16.hysteresis", "hysteresis", as_count, _FP16),
    DeepSpeedKey("fp16.min_loss_scale", "min_loss_scale", as_float,
                 _FP16),
    DeepSpeedKey("fp16.consecutive_hysteresis", "consecutive_hysteresis",
                 as_bool, _FP16),
    DeepSpeedKey("bf16.enabled", "compute_dtype", None,
                 "true: \"bfloat16\" (old alias: bfloat16.enabled)"),
    DeepSpeedKey("bf16.check_grad_overflow", "skip_nonfinite", None,
                 "copied; read only with bf16.enabled (absent: true, "
                 "DeepSpeed's default)"),
    DeepSpeedKey("data_types.grad_accum_dtype", "", None,
                 "\"fp32\" only: gradients accumulate in float32"),
    DeepSpeedKey("zero_optimization.stage", "stage", _stage,
                 "zero_optimization absent or false: 0"),
    DeepSpeedKey("zero_optimization.stage3_param_persistence_threshold",
                 "min_shard_elements", _persistence,
                 "the threshold + 1 (absent: 1024)"),
    DeepSpeedKey("zero_optimization.zero_quantized_weights",
                 "quantized_weights", as_bool,
                 "ZeRO++'s qwZ: int8 parameter all-gathers; stage 3 only"),
    DeepSpeedKey("zero_optimization.zero_quantized_gradients",
                 "quantized_gradients", as_bool,
                 "ZeRO++'s qgZ: int8 gradient all-to-alls, summed in "
                 "float32; stages 1-3"),
    DeepSpeedKey("zero_optimization.zero_hpz_partition_size",
                 "hpz_partition_size", as_count,
                 "ZeRO++'s hpZ, stage 3: devices per group (a node); the "
                 "mesh must be make_mesh(replica=devices // it)"),
    DeepSpeedKey("zero_optimization.offload_optimizer.device",
                 "offload_optimizer", None,
                 _DEVICE + "; \"nvme\": \"nvme\" with update_on=\"host\" "
                 "(the NVMe tier updates the state on the host, as "
                 "DeepSpeed's CPU optimizer does; a warning says so)"),
    DeepSpeedKey("zero_optimization.offload_optimizer.nvme_path",
                 "nvme_path", as_str,
                 "copied; needed with device \"nvme\" (otherwise no effect)"),
    DeepSpeedKey("zero_optimization.offload_optimizer.buffer_count",
                 "nvme.buffer_count", _positive,
                 "slices host RAM holds at once; " + _ON_NVME),
    DeepSpeedKey("zero_optimization.offload_optimizer.pipeline_read",
                 "nvme.read_ahead", as_bool,
                 "copied; absent: true, zero_jax's default (DeepSpeed's is "
                 "false; the overlap leaves results the same; a warning "
                 "says so); " + _ON_NVME),
    DeepSpeedKey("zero_optimization.offload_optimizer.pipeline_write",
                 "nvme.write_behind", as_bool,
                 "copied; absent: true, as pipeline_read; " + _ON_NVME),
    DeepSpeedKey("aio.block_size", "nvme.block_bytes", _positive,
                 "copied: the largest request, a multiple of 4096 (absent: "
                 "zero_jax's 8 MiB; DeepSpeed's is 1 MiB); " + _ON_NVME),
    DeepSpeedKey("aio.queue_depth", "nvme.in_flight", _positive, _THREADS),
    DeepSpeedKey("aio.intra_op_parallelism", "nvme.in_flight", _positive,
                 _THREADS),
    DeepSpeedKey("aio.thread_count", "nvme.in_flight", _positive,
                 "intra_op_parallelism's name before DeepSpeed 0.16.4, read "
                 "as it; " + _ALIAS),
    DeepSpeedKey("aio.num_threads", "nvme.in_flight", _positive,
                 "intra_op_parallelism as DeepNVMe's ds_nvme_tune writes it, "
                 "read as it; " + _ALIAS),
    DeepSpeedKey("zero_optimization.offload_param.device", "offload_params",
                 None, _DEVICE + "; stage 3 only; \"nvme\" is refused "
                 "(parameters on NVMe are not implemented)"),
    DeepSpeedKey("zero_optimization.cpu_offload", "offload_optimizer", None,
                 "deprecated; true: \"host\" (with a warning)"),
    DeepSpeedKey("zero_optimization.cpu_offload_param", "offload_params",
                 None, "deprecated; true: \"host\" (with a warning); stage 3 "
                 "only"),
    DeepSpeedKey("activation_checkpointing.partition_activations", "remat",
                 None, "true: \"full\" (each layer keeps only its inputs) "
                 "and partition_activations=True (the inputs split over the "
                 "'model' axis along the sequence; without one they are "
                 "already split over data with the batch)"),
    DeepSpeedKey("amp.enabled", "compute_dtype", None,
                 "true (NVIDIA Apex AMP): \"float16\" for opt_level O1 or "
                 "O2, with float32 master weights; an error with fp16, bf16 "
                 "or ZeRO (stage > 0) enabled, as in DeepSpeed"),
    DeepSpeedKey("amp.opt_level", "compute_dtype", None,
                 "\"O1\" (Apex's default) or \"O2\": \"float16\"; "
                 "\"O0\": float32; \"O3\" (no float32 master weights) is "
                 "refused"),
    DeepSpeedKey("amp.loss_scale", "loss_scale", None,
                 "\"dynamic\" (Apex's default): dynamic loss scaling as "
                 "Apex's (initial_scale_power 16, loss_scale_window 2000, "
                 "hysteresis 1); a number: that static scale"),
    DeepSpeedKey("amp.min_loss_scale", "min_loss_scale", None,
                 "copied, with a dynamic loss_scale (absent: 1)"),
    DeepSpeedKey("activation_checkpointing.cpu_checkpointing", "remat",
                 None, "true: \"offload_to_host\" of the layer inputs "
                 "scan_layers tags \"layer_input\" (remat_names, a keyword, "
                 "replaces them with other checkpoint_name tags)"),
)
ROWS = {row.key: row for row in MAPPING}


def mapping_table_markdown() -> str:
  """The DeepSpeed to ZeroConfig key map as a Markdown table, for the docs.

  Rendered from ``MAPPING``, the table ``from_deepspeed`` translates by, so
  docs made from it say what the code does.

  Returns:
    The table (a header, a separator and one line per key), ending in a
    newline.
  """
  lines = ["| DeepSpeed key | ZeroConfig field | value |",
           "| --- | --- | --- |"]
  for row in MAPPING:
    field = _field(row.field) if row.field else "(none)"
    lines.append(f"| `{row.key}` | {field} | {row.note or 'copied'} |")
  return "\n".join(lines) + "\n"


def _field(field: str) -> str:
  """A row's field as the docs write it: where it lives in the nested
  config, and its shorthand."""
  head, _, rest = field.partition(".")
  where = SHORTHAND.get(head)
  if where is None:
    return f"`{field}`"
  full = ".".join(where + ((rest,) if rest else ()))
  return f"`{full}` (`{field}`)"


def _cell(text: str) -> str:
  return text.replace("|", "\\|")


def key_list_markdown() -> str:
  """Every DeepSpeed key zero_jax knows, and what it does with each, as a
  Markdown table: translated (``MAPPING``), an alias, accepted without
  effect (with the reason), accepted at DeepSpeed's default only, accepted
  while disabled, or refused (with the reason and the fix). Any other key
  is refused as unknown.

  Returns:
    The table, ending in a newline.
  """
  lines = ["| DeepSpeed key | zero_jax | why, or how |",
           "| --- | --- | --- |"]
  for row in MAPPING:
    to = f"mapped to {_field(row.field)}" if row.field else "read"
    lines.append(f"| `{row.key}` | {to} | "
                 f"{_cell(row.note or 'copied')} |")
  for name, alias in ALIASES.items():
    lines.append(f"| `{name}` | alias | read as `{alias}` |")
  for key, (_, only, why) in NO_EFFECT_KEYS.items():
    if only is ANY:
      lines.append(f"| `{key}` | no effect | {_cell(why)} |")
  for key, instead in NOT_READ_BY_DEEPSPEED.items():
    lines.append(f"| `{key}` | not read by DeepSpeed | accepted with a "
                 f"warning: DeepSpeed reads {instead} instead; no effect in "
                 "zero_jax either |")
  for key, default in DEFAULT_ONLY.items():
    lines.append(f"| `{key}` | accepted at DeepSpeed's default "
                 f"`{_json(default)}` only | otherwise refused: "
                 f"{_cell(UNSUPPORTED_WHY[key])} |")
  for key, (_, only, _) in NO_EFFECT_KEYS.items():
    if only is not ANY:
      lines.append(f"| `{key}` | accepted at DeepSpeed's default "
                   f"`{_json(only)}` only | otherwise refused: "
                   f"{_cell(UNSUPPORTED_WHY[key])} |")
  for key in SWITCHED:
    lines.append(f"| `{key}` | accepted while disabled | enabled: refused: "
                 f"{_cell(UNSUPPORTED_WHY[key])} |")
  for key, why in UNSUPPORTED_WHY.items():
    if (key in DEFAULT_ONLY or key in NO_EFFECT_KEYS or key in SWITCHED or
        key in ROWS):
      continue
    lines.append(f"| `{key}` | refused | {_cell(why)} |")
  return "\n".join(lines) + "\n"


def _json(value: Any) -> str:
  if isinstance(value, bool):
    return "true" if value else "false"
  return str(value)

