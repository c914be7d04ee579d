"""The walk over a DeepSpeed config that collects ``ZeroConfig`` keywords,
the keys zero_jax refuses and the warnings about the keys it accepts.

``read_deepspeed`` fills in ``"auto"`` first (``_ds_auto``), then hands the
config to a ``Translator``, which reads the keys of ``MAPPING``
(``_ds_mapping``; the NVMe keys with ``_ds_nvme``) and sorts every other
key by the tables of ``_ds_keys``.
"""

from __future__ import annotations

from typing import Any, Mapping

from zero_jax._checks import check_choice, check_float, fail
from zero_jax.config._ds_keys import (ANY, DEFAULT_ONLY, DTYPES,
                                     NO_EFFECT_KEYS, NOT_READ_BY_DEEPSPEED,
                                     QUIET, SWITCHED, UNKNOWN,
                                     UNSUPPORTED_WHY, as_bool, as_number,
                                     as_str, is_auto, key_name, warn)
from zero_jax.config._ds_mapping import MAPPING, ROWS
from zero_jax.config._ds_nvme import read_aio, read_optimizer

class Translator:
  """Walks a DeepSpeed config, collecting ZeroConfig kwargs and problems."""

  def __init__(self, unsupported: str, known: Mapping[str, Any],
               with_optimizer: bool):
    self.mode = unsupported
    self.known = known
    self.with_optimizer = with_optimizer
    self.kwargs: dict[str, Any] = {}
    self.problems: list[tuple[str, str]] = []  # (dotted key, why)
    self.notes: list[str] = []  # warnings about accepted keys
    self.no_effect: list[str] = []
    self.optimizer: Mapping[str, Any] | None = None
    self.scheduler: Mapping[str, Any] | None = None
    # ZeroConfig field -> the DeepSpeed key that gave it, for ZeroConfig's
    # errors.
    self.sources: dict[str, str] = {}
    # ZeroConfig.nvme's fields read (NvmeOptions field -> value), and the
    # DeepSpeed key(s) that gave each, named for errors.
    self.nvme: dict[str, Any] = {}
    self.nvme_keys: dict[str, str] = {}

  # Reading one key.

  def get(self, section: Mapping[str, Any], key: str, prefix: str) -> Any:
    """The value of ``key`` (None when absent or null); rejects "auto"."""
    value = section.get(key)
    if is_auto(value):
      raise ValueError(
          f"{key_name(prefix + key)} is \"auto\": replace 'auto' with a "
          "value (no keyword fills it here)")
    return value

  def section(self, parent: Mapping[str, Any], key: str,
              prefix: str) -> Mapping[str, Any]:
    value = self.get(parent, key, prefix)
    if value is None:
      return {}
    if not isinstance(value, Mapping):
      fail(key_name(prefix + key), "an object ({...})", value)
    return value

  def set(self, field: str, value: Any, key: str) -> None:
    self.kwargs[field] = value
    self.sources[field] = key

  def mapped(self, section: Mapping[str, Any], prefix: str) -> set[str]:
    """Translates the keys of ``MAPPING`` directly under ``prefix`` that
    have a ``read``; returns the names of all its keys there (handled)."""
    rows = [row for row in MAPPING if row.prefix == prefix]
    for row in rows:
      if row.read is None:
        continue
      value = self.get(section, row.leaf, prefix)
      if value is not None:
        self.set(row.field, row.read(row.key, value), row.key)
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
        check, only, _ = NO_EFFECT_KEYS[path]
        value = check(path, value)
        if only is ANY or value == only:
          if path not in QUIET:
            self.no_effect.append(path)
        else:
          self.unsupported(path)
      elif path in DEFAULT_ONLY:
        value = section[key]
        if value is not None and (type(value) is not type(DEFAULT_ONLY[path])
                                  or value != DEFAULT_ONLY[path]):
          self.unsupported(path)
      elif path in SWITCHED:
        self.switched(section, key)
      elif path in NOT_READ_BY_DEEPSPEED:
        self.not_read(path, section[key])
      else:
        self.unsupported(path)

  # Sections.

  def top(self, config: Mapping[str, Any]) -> None:
    handled = self.mapped(config, "") | {
        "fp16", "bf16", "bfloat16", "data_types", "zero_optimization",
        "activation_checkpointing", "amp", "aio"}
    for name in ("optimizer", "scheduler"):
      if name not in config:
        continue
      if not self.with_optimizer:
        self.unsupported(name)
        continue
      value = self.section(config, name, "")
      setattr(self, name, value or None)
    self.precision(config)
    self.data_types(self.section(config, "data_types", ""))
    self.zero(config)
    read_aio(self, self.section(config, "aio", ""))  # (after the device)
    self.activation_checkpointing(
        self.section(config, "activation_checkpointing", ""))
    self.amp(self.section(config, "amp", ""))
    self.rest(config, "", handled)

  def not_read(self, path: str, value: Any) -> None:
    """A key DeepSpeed does not read either: a warning naming the key it
    reads instead (and that an ``enabled: true`` in it logs nothing)."""
    on = isinstance(value, Mapping) and any(
        v is True for k, v in value.items() if k == "enabled")
    self.notes.append(
        f"{path!r} is not read by DeepSpeed either (it reads "
        f"{NOT_READ_BY_DEEPSPEED[path]} instead); it changes nothing in "
        "zero_jax" + ("; its \"enabled\": true logs nothing, in DeepSpeed "
                      "or here" if on else ""))

  def amp(self, section: Mapping[str, Any]) -> None:
    """Apex AMP (``amp.initialize(model, optimizer, **params)`` in
    DeepSpeed's engine): O1 and O2 read as float16 compute with float32
    master weights and Apex's dynamic loss scaling; O0 as float32."""
    p = "amp."
    on = self.get(section, "enabled", p)
    if on is None or not as_bool(p + "enabled", on):
      return  # (DeepSpeed reads nothing else of a disabled section)
    for key, what in (("compute_dtype", "its fp16 or bf16 mode"),
                      ("stage", "ZeRO")):
      source = self.sources.get(key, "zero_optimization.stage")
      if self.kwargs.get(key) in ("float16", "bfloat16", 1, 2, 3):
        raise ValueError(
            f"{key_name(p + 'enabled')} and {key_name(source)} are both set: "
            f"DeepSpeed refuses Apex AMP together with {what} (its engine "
            "raises); set fp16.enabled to true (what amp O2 does) and "
            "amp.enabled to false")
    level = self.get(section, "opt_level", p)
    level = "O1" if level is None else as_str(p + "opt_level",
                                                level).strip().upper()
    check_choice(key_name(p + "opt_level"), level, ("O0", "O1", "O2", "O3"))
    handled = {"enabled", "opt_level", "loss_scale", "min_loss_scale"}
    # (null: Apex's default for the opt_level, as if absent.)
    rest = {k: v for k, v in section.items() if v is not None}
    if level == "O3":
      self.unsupported(p + "opt_level")
      self.rest(rest, p, handled)
      return
    if level == "O0":
      self.notes.append(
          "'amp' is enabled with opt_level O0, Apex's float32 training: "
          "read as compute_dtype float32 (no mixed precision, no loss "
          "scaling)")
      self.rest(rest, p, handled)
      return
    self.set("compute_dtype", "float16", p + "enabled")
    scale = self.get(section, "loss_scale", p)
    if scale is None or (isinstance(scale, str) and
                         scale.strip().lower() == "dynamic"):
      # Apex's LossScaler: 2**16 at first, halved on every overflow,
      # doubled after 2000 clean steps.
      for field, value in (("initial_scale_power", 16),
                           ("loss_scale_window", 2000), ("hysteresis", 1)):
        self.set(field, value, p + "loss_scale")
      low = self.get(section, "min_loss_scale", p)
      if low is not None:
        self.set("min_loss_scale", as_number(p + "min_loss_scale", low,
                                             minimum=0.0, strict=True),
                 p + "min_loss_scale")
      how = ("dynamic loss scaling as Apex does it (2**16 at first, halved "
             "on every overflow, doubled after 2000 clean steps)")
    else:
      self.set("loss_scale", as_number(p + "loss_scale", scale,
                                       minimum=0.0, strict=True),
               p + "loss_scale")
      how = f"the static loss scale {scale}"
    self.notes.append(
        f"'amp' (NVIDIA Apex AMP, opt_level {level}) is read as fp32 master "
        f"weights, float16 compute (compute_dtype=\"float16\") and {how}; "
        "zero_jax casts every parameter, not per operation as Apex O1 does")
    self.rest(rest, p, handled)

  def switched(self, config: Mapping[str, Any], name: str) -> None:
    """A section with an "enabled" switch: accepted when off."""
    section = self.section(config, name, "")
    enabled = section.get("enabled")
    if enabled is not None and as_bool(f"{name}.enabled",
                                       self.get(section, "enabled",
                                                f"{name}.")):
      self.unsupported(name)

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
    overflow = self.get(bf16, "check_grad_overflow", f"{bf16_key}.")
    if overflow is not None:
      overflow = as_bool(f"{bf16_key}.check_grad_overflow", overflow)
      if bf16_on:
        self.set(ROWS["bf16.check_grad_overflow"].field, overflow,
                 f"{bf16_key}.check_grad_overflow")
    self.rest(bf16, f"{bf16_key}.", {"enabled", "check_grad_overflow"})
    if bf16_on:
      self.set(ROWS["bf16.enabled"].field, "bfloat16", f"{bf16_key}.enabled")
    if not fp16_on:
      # DeepSpeed ignores the other fp16 keys when fp16 is off; so do we
      # (but still flags keys it does not know, most likely typos).
      known = {row.leaf for row in MAPPING if row.prefix == "fp16."}
      self.rest(fp16, "fp16.", known | {
          k.split(".", 1)[1] for k in UNSUPPORTED_WHY if
          k.startswith("fp16.")})
      return
    self.set(ROWS["fp16.enabled"].field, "float16", "fp16.enabled")
    p = "fp16."
    handled = self.mapped(fp16, p)
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
    for old, new in (("cpu_offload", "offload_optimizer"),
                     ("cpu_offload_param", "offload_param")):
      value = self.get(zero, old, p)
      if value is None or not as_bool(p + old, value):
        continue
      if zero.get(new) is not None:
        raise ValueError(
            f"{key_name(p + old)} (deprecated) and {key_name(p + new)} both "
            f"set the offload; keep {new}: {{\"device\": \"cpu\"}}")
      row = ROWS[p + old]
      self.set(row.field, "host", row.key)
      self.notes.append(
          f"'{p}{old}': true is deprecated in DeepSpeed; read as {new}: "
          "{\"device\": \"cpu\"} (write that instead)")
    self.rest(zero, p, handled | {"offload_optimizer", "offload_param"})

  def offload_device(self, section: Mapping[str, Any], p: str,
                     devices: tuple[str, ...]) -> str:
    """Reads ``device`` (one of ``devices``) and sets its ``MAPPING`` field
    to "host" for "cpu" ("nvme" is ``read_optimizer``'s)."""
    device = self.get(section, "device", p)
    device = "none" if device is None else as_str(
        p + "device", device).strip().lower()
    if device == "nvme" and "nvme" not in devices:
      raise ValueError(
          f"{key_name(p + 'device')} is \"nvme\": parameters on NVMe are "
          "not implemented in zero_jax yet; use \"cpu\" to keep the "
          "parameters' fp32 master shards in host memory (stage 3), or put "
          "the optimizer state on NVMe instead with "
          "zero_optimization.offload_optimizer.device \"nvme\"")
    if device not in devices:
      fail(key_name(p + "device"),
           " or ".join(f'"{d}"' for d in devices), device)
    if device == "cpu":
      self.set(ROWS[p + "device"].field, "host", p + "device")
    return device

  def offload_optimizer(self, section: Mapping[str, Any]) -> None:
    p = "zero_optimization.offload_optimizer."
    device = self.offload_device(section, p, ("cpu", "nvme", "none"))
    handled = read_optimizer(self, section, device)
    ratio = self.get(section, "ratio", p)
    if ratio is not None:
      ratio = check_float(key_name(p + "ratio"), ratio, maximum=1.0)
      if ratio < 1 and device != "none":
        self.notes.append(
            f"'{p}ratio' is {ratio}: zero_jax offloads all of the optimizer "
            "state, not a fraction of it")
    self.rest(section, p, {"device", "ratio"} | handled)

  def offload_param(self, section: Mapping[str, Any]) -> None:
    p = "zero_optimization.offload_param."
    self.offload_device(section, p, ("cpu", "none"))
    self.rest(section, p, {"device"})

  def activation_checkpointing(self, section: Mapping[str, Any]) -> None:
    p = "activation_checkpointing."
    on = {}
    for leaf in ("partition_activations", "cpu_checkpointing"):
      value = self.get(section, leaf, p)
      on[leaf] = value is not None and as_bool(p + leaf, value)
    if on["cpu_checkpointing"]:
      # DeepSpeed moves the checkpointed layer inputs to host memory:
      # zero_jax.scan_layers tags them "layer_input" (plus any tags of the
      # caller's own remat_names).
      names = tuple(self.known.get("remat_names") or ()) or ("layer_input",)
      self.set("remat", "offload_to_host", p + "cpu_checkpointing")
      self.set("remat_names", names, p + "cpu_checkpointing")
    elif on["partition_activations"]:
      self.set("remat", "full", p + "partition_activations")
    if on["partition_activations"]:
      self.set("partition_activations", True, p + "partition_activations")
    self.rest(section, p, set(on))

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
      by_reason: dict[str, list[str]] = {}
      for path in self.no_effect:
        by_reason.setdefault(NO_EFFECT_KEYS[path][2], []).append(path)
      lines = [f"{', '.join(keys)} ha{'ve' if len(keys) > 1 else 's'} no "
               f"effect in zero_jax: {why}" for why, keys in
               by_reason.items()]
      warn(f"DeepSpeed config{source}: " + ";\n".join(lines) +
           "\n(remove them to silence this warning)")
