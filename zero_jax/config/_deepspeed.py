"""Reads a DeepSpeed JSON config into a ``ZeroConfig``.

``from_deepspeed(path_or_dict)`` (also ``zero_jax.from_deepspeed``)
translates the parts of a DeepSpeed config that zero_jax implements and
refuses the rest by name, so that a config written for DeepSpeed either
means the same thing here or fails loudly::

  cfg = zero_jax.from_deepspeed("ds_config.json")
  engine = zero_jax.Engine(loss_fn, optax.adamw(3e-4), cfg, mesh)

The keys understood, and the ``ZeroConfig`` field each sets, are the rows
of ``MAPPING``, the one table the translation reads;
``mapping_table_markdown()`` renders it for the docs. An absent key takes
ZeroConfig's default, which is DeepSpeed's except where noted; a JSON
``null`` counts as absent. What happens to every other key is in the tables
of ``_ds_keys``, beside this module.

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
* Offload: ``"nvme"`` is always an error (zero_jax has no disk offload).
  ``offload_optimizer``'s ``pin_memory``, ``buffer_count``, ``fast_init``,
  ``pipeline_read``, ``pipeline_write`` and ``nvme_path`` are accepted and
  have no effect (JAX pins host memory itself); ``ratio`` below 1 warns, as
  all of the state is offloaded.
* The performance knobs in ``_ds_keys.NO_EFFECT_KEYS`` (bucket sizes,
  overlap, prefetching, printing...) are accepted with one warning listing
  them: XLA schedules zero_jax's communication, so they change nothing.
* Everything else (``optimizer``, ``scheduler``, ``activation_checkpointing``,
  ``amp``, monitoring, ``pipeline``, ``moe``, unknown keys...) is refused with
  a ``ValueError`` naming the dotted key and what to do instead; with
  ``unsupported="warn"`` each becomes a ``UserWarning`` and is dropped. Build
  the optimizer and its schedule with optax and pass it to ``Engine``.
* HuggingFace's ``"auto"`` placeholder is an error wherever it is read:
  the Trainer fills those in, zero_jax does not.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, Mapping

from zero_jax._checks import check_choice, check_float, fail
from zero_jax.config._config import STAGES, ZeroConfig
from zero_jax.config._ds_keys import (ANY, DEFAULT_ONLY, DTYPES,
                                     NO_EFFECT_KEYS, UNKNOWN,
                                     UNSUPPORTED_WHY, as_bool, as_count,
                                     as_float, as_int, as_number, as_size,
                                     as_str, is_auto, key_name, load_config,
                                     warn)

_MODES = ("error", "warn")


@dataclasses.dataclass(frozen=True)
class DeepSpeedKey:
  """One row of the DeepSpeed to ZeroConfig map.

  Attributes:
    key: the dotted DeepSpeed key.
    field: the ``ZeroConfig`` field it sets ("" for none).
    read: ``(key, value) -> field value`` for a present, non-null value:
      checks it (the error names the key) and converts it. None where the
      translator reads the key itself (a switch, an offload device).
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


def _persistence(key: str, value: Any) -> int:
  # DeepSpeed keeps leaves with <= threshold elements whole; zero_jax
  # those with < min_shard_elements.
  return as_size(key, value) + 1


_FP16 = "read only with fp16.enabled"
_DEVICE = "\"cpu\": \"host\", \"none\": None; \"nvme\" is an error"

# The DeepSpeed keys zero_jax translates, in the order it reads them.
MAPPING: tuple[DeepSpeedKey, ...] = (
    DeepSpeedKey("train_batch_size", "train_batch_size", as_count),
    DeepSpeedKey("train_micro_batch_size_per_gpu", "micro_batch_size",
                 as_count),
    DeepSpeedKey("gradient_accumulation_steps", "grad_accum_steps",
                 as_count),
    DeepSpeedKey("gradient_clipping", "clip_grad_norm", _clip, "0: none"),
    DeepSpeedKey("communication_data_type", "reduce_dtype", _reduce_dtype,
                 "\"fp32\", \"fp16\", \"bf16\" (absent: float32)"),
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
    DeepSpeedKey("data_types.grad_accum_dtype", "", None,
                 "\"fp32\" only: gradients accumulate in float32"),
    DeepSpeedKey("zero_optimization.stage", "stage", _stage,
                 "zero_optimization absent or false: 0"),
    DeepSpeedKey("zero_optimization.stage3_param_persistence_threshold",
                 "min_shard_elements", _persistence,
                 "the threshold + 1 (absent: 1024)"),
    DeepSpeedKey("zero_optimization.offload_optimizer.device",
                 "offload_optimizer", None, _DEVICE),
    DeepSpeedKey("zero_optimization.offload_param.device", "offload_params",
                 None, _DEVICE + "; stage 3 only"),
)
_ROWS = {row.key: row for row in MAPPING}


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
    field = f"`{row.field}`" if row.field else "(none)"
    lines.append(f"| `{row.key}` | {field} | {row.note or 'copied'} |")
  return "\n".join(lines) + "\n"


class _Translator:
  """Walks a DeepSpeed config, collecting ZeroConfig kwargs and problems."""

  def __init__(self, unsupported: str):
    self.mode = unsupported
    self.kwargs: dict[str, Any] = {}
    self.problems: list[tuple[str, str]] = []  # (dotted key, why)
    self.notes: list[str] = []  # warnings about accepted keys
    self.no_effect: list[str] = []
    # ZeroConfig field -> the DeepSpeed key that gave it, for ZeroConfig's
    # errors.
    self.sources: dict[str, str] = {}

  # Reading one key.

  def get(self, section: Mapping[str, Any], key: str, prefix: str) -> Any:
    """The value of ``key`` (None when absent or null); rejects "auto"."""
    value = section.get(key)
    if is_auto(value):
      raise ValueError(
          f"{key_name(prefix + key)} is \"auto\": replace 'auto' with a "
          "number (or true/false): HuggingFace Trainer fills these in, "
          "zero_jax does not")
    return value

  def section(self, parent: Mapping[str, Any], key: str,
              prefix: str) -> Mapping[str, Any]:
    value = self.get(parent, key, prefix)
    if value is None:
      return {}
    if not isinstance(value, Mapping):
      fail(key_name(prefix + key), "an object ({...})", value)
    return value

  def mapped(self, section: Mapping[str, Any], prefix: str) -> set[str]:
    """Translates the keys of ``MAPPING`` directly under ``prefix`` that
    have a ``read``; returns the names of all its keys there (handled)."""
    rows = [row for row in MAPPING if row.prefix == prefix]
    for row in rows:
      value = self.get(section, row.leaf, prefix)
      if row.read is not None and value is not None:
        self.kwargs[row.field] = row.read(row.key, value)
        self.sources[row.field] = row.key
    return {row.leaf for row in rows}

  def unsupported(self, path: str) -> None:
    self.problems.append((path, UNSUPPORTED_WHY.get(path, UNKNOWN)))

  def rest(self, section: Mapping[str, Any], prefix: str,
           handled: set[str]) -> None:
    """Sorts the keys not in ``handled``: no-effect, default, unsupported."""
    for key in section:
      if key in handled:
        continue
      path = f"{prefix}{key}"
      if path in NO_EFFECT_KEYS:
        value = self.get(section, key, prefix)
        if value is None:
          continue
        check, only = NO_EFFECT_KEYS[path]
        value = check(path, value)
        if only is ANY or value == only:
          self.no_effect.append(path)
        else:
          self.unsupported(path)
      elif path in DEFAULT_ONLY:
        value = section[key]
        if value is not None and (type(value) is not type(DEFAULT_ONLY[path])
                                  or value != DEFAULT_ONLY[path]):
          self.unsupported(path)
      else:
        self.unsupported(path)

  # Sections.

  def top(self, config: Mapping[str, Any]) -> None:
    handled = self.mapped(config, "") | {
        "fp16", "bf16", "bfloat16", "data_types", "zero_optimization"}
    self.precision(config)
    self.data_types(self.section(config, "data_types", ""))
    self.zero(config)
    self.rest(config, "", handled)

  def precision(self, config: Mapping[str, Any]) -> None:
    fp16 = self.section(config, "fp16", "")
    fp16_on = fp16.get("enabled") is not None and as_bool(
        "fp16.enabled", self.get(fp16, "enabled", "fp16."))
    if "bf16" in config and "bfloat16" in config:
      raise ValueError("the DeepSpeed config has both 'bf16' and its old "
                       "alias 'bfloat16'; keep only 'bf16'")
    bf16_key = "bfloat16" if "bfloat16" in config else "bf16"
    bf16 = self.section(config, bf16_key, "")
    bf16_on = bf16.get("enabled") is not None and as_bool(
        f"{bf16_key}.enabled", self.get(bf16, "enabled", f"{bf16_key}."))
    if fp16_on and bf16_on:
      raise ValueError(
          f"the DeepSpeed config enables both fp16 and {bf16_key}; enable "
          "one (bf16 needs no loss scaling)")
    self.rest(bf16, f"{bf16_key}.", {"enabled"})
    if bf16_on:
      self.kwargs[_ROWS["bf16.enabled"].field] = "bfloat16"
    if not fp16_on:
      # DeepSpeed ignores the other fp16 keys when fp16 is off; so do we
      # (but still flags keys it does not know, most likely typos).
      known = {row.leaf for row in MAPPING if row.prefix == "fp16."}
      self.rest(fp16, "fp16.", known | {
          k.split(".", 1)[1] for k in UNSUPPORTED_WHY if
          k.startswith("fp16.")})
      return
    self.kwargs[_ROWS["fp16.enabled"].field] = "float16"
    p = "fp16."
    handled = self.mapped(fp16, p)
    value = self.get(fp16, "auto_cast", p)
    if value is not None:
      as_bool(p + "auto_cast", value)
    self.rest(fp16, p, handled)

  def data_types(self, section: Mapping[str, Any]) -> None:
    value = self.get(section, "grad_accum_dtype", "data_types.")
    if value is not None:
      name = as_str("data_types.grad_accum_dtype", value).strip().lower()
      if DTYPES.get(name) != "float32":
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
    self.kwargs["stage"] = 0  # (absent: 0, not ZeroConfig's default)
    handled = self.mapped(zero, p)
    self.offload_optimizer(self.section(zero, "offload_optimizer", p))
    self.offload_param(self.section(zero, "offload_param", p))
    self.rest(zero, p, handled | {"offload_optimizer", "offload_param"})

  def offload_device(self, section: Mapping[str, Any], p: str,
                     what: str) -> str:
    """Reads ``device`` ("none" or "cpu"; "nvme" is always an error) and
    sets its ``MAPPING`` field to "host" for "cpu"."""
    device = self.get(section, "device", p)
    device = "none" if device is None else as_str(
        p + "device", device).strip().lower()
    if device == "nvme":
      raise ValueError(
          f"{key_name(p + 'device')} is \"nvme\": disk (NVMe) offload does "
          f"not exist in zero_jax; use \"cpu\" to keep the {what} in host "
          "memory")
    if device not in ("none", "cpu"):
      fail(key_name(p + "device"), "\"cpu\" or \"none\"", device)
    if device == "cpu":
      self.kwargs[_ROWS[p + "device"].field] = "host"
    return device

  def offload_optimizer(self, section: Mapping[str, Any]) -> None:
    p = "zero_optimization.offload_optimizer."
    device = self.offload_device(section, p, "optimizer state")
    checks = {"pin_memory": as_bool, "fast_init": as_bool,
              "pipeline_read": as_bool, "pipeline_write": as_bool,
              "buffer_count": as_size, "nvme_path": as_str}
    for key, check in checks.items():
      value = self.get(section, key, p)
      if value is not None:
        check(p + key, value)
    ratio = self.get(section, "ratio", p)
    if ratio is not None:
      ratio = check_float(key_name(p + "ratio"), ratio, maximum=1.0)
      if ratio < 1 and device == "cpu":
        self.notes.append(
            f"'{p}ratio' is {ratio}: zero_jax offloads all of the optimizer "
            "state, not a fraction of it")
    self.rest(section, p, {"device", "ratio", *checks})

  def offload_param(self, section: Mapping[str, Any]) -> None:
    p = "zero_optimization.offload_param."
    self.offload_device(section, p, "parameters")
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
      warn(f"{key_name(path)} is not supported by zero_jax and "
           f"was dropped: {why}")
    for note in self.notes:
      warn(f"DeepSpeed config{source}: {note}")
    if self.no_effect:
      warn(
          f"DeepSpeed config{source}: {', '.join(self.no_effect)} ha"
          f"{'ve' if len(self.no_effect) > 1 else 's'} no effect in zero_jax: "
          "XLA schedules its communication (bucketing, overlap, "
          "prefetching) and results do not depend on these settings; remove "
          "them to silence this warning")


def from_deepspeed(config: str | os.PathLike | Mapping[str, Any], *,
                   unsupported: str = "error") -> ZeroConfig:
  """Translates a DeepSpeed JSON config into a ``ZeroConfig``.

  ``MAPPING`` lists the keys translated and how (``mapping_table_markdown``
  renders it); the module docstring says what happens to the others.

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
  data, path = load_config(config)
  source = f" {path!r}" if path is not None else ""
  translator = _Translator(unsupported)
  try:
    translator.top(data)
  except ValueError as e:
    if path is None:
      raise
    raise ValueError(f"{e} (in {path!r})") from None
  translator.finish(source)
  try:
    return ZeroConfig(**translator.kwargs)
  except ValueError as e:
    sources = [f"{field} is {key!r}" for field, key in
               translator.sources.items()
               if re.search(rf"\b{field}\b", str(e))]
    raise ValueError(
        f"DeepSpeed config{source} gives an invalid ZeroConfig: {e}" +
        (f" (in DeepSpeed's terms: {'; '.join(sources)})" if sources else "")
    ) from None

