"""Reads a DeepSpeed JSON config into a ``ZeroConfig``.

``from_deepspeed(path_or_dict, **known)`` (also ``zero_jax.from_deepspeed``)
translates the parts of a DeepSpeed config that zero_jax implements and
refuses the rest by name, so that a config written for DeepSpeed either
means the same thing here or fails loudly::

  cfg = zero_jax.from_deepspeed("ds_config.json")
  engine = zero_jax.Engine(loss_fn, optax.adamw(3e-4), cfg, mesh)

``zero_jax.initialize`` reads the same config with ``read_deepspeed``, which
also returns its ``optimizer`` and ``scheduler`` sections, and builds the
optax transformation from them.

The keys understood, and the ``ZeroConfig`` field each sets, are the rows
of ``MAPPING``, the one table the translation reads;
``mapping_table_markdown()`` renders it for the docs, and
``key_list_markdown()`` every key DeepSpeed's schema has with what zero_jax
does with it. An absent key takes ZeroConfig's default, which is
DeepSpeed's except where noted; a JSON ``null`` counts as absent. What
happens to every other key is in the tables of ``_ds_keys``, beside this
module.

Notes on the mapping:

* HuggingFace's ``"auto"``: filled in from the keywords HuggingFace's Trainer
  fills them from (``AUTO_KEYWORDS``: ``per_device_train_batch_size``,
  ``learning_rate``, ...); a batch size the other two determine is left to
  ``ZeroConfig.batch_sizes``, which derives it on the mesh's devices as
  DeepSpeed does; a key without effect in zero_jax needs no value. Every
  ``"auto"`` left is reported in one error, with the keyword that fills it
  (and, where ``from_deepspeed`` meets ``optimizer`` or ``scheduler``
  sections, theirs too, naming ``zero_jax.initialize``, which reads them).
  A keyword that contradicts a value the config writes is an error too, as
  in the Trainer.
* DeepSpeed's field names and their aliases (``param_persistence_threshold``
  and ``stage3_param_persistence_threshold``) are both read (``ALIASES``).
* The batch sizes are copied, not resolved: ``ZeroConfig.batch_sizes``
  applies DeepSpeed's ``train = micro x accum x devices`` rule once the
  device count is known.
* The fp16 keys other than ``enabled`` are read only when fp16 is enabled
  (DeepSpeed ignores them too); ``fp16.auto_cast`` may only be false.
* ``communication_data_type`` absent: gradients are summed in the compute
  dtype, as DeepSpeed sums them (with ``loss_scope="per_device"``, in
  float32: zero_jax's per-device default); ``"fp32"`` with 16-bit compute
  needs ``loss_scope="per_device"``, whose own collectives sum 16-bit
  gradients in float32.
* DeepSpeed keeps a parameter whole when it has *at most*
  ``stage3_param_persistence_threshold`` elements; zero_jax when it has
  *fewer than* ``min_shard_elements``, so the field is the threshold + 1.
  Absent, zero_jax's default (1024) applies, not DeepSpeed's (1e5).
* Offload: ``offload_optimizer.device: "nvme"`` reads as
  ``offload_optimizer="nvme"`` with ``update_on="host"`` (a warning says
  so) and needs ``nvme_path``; its ``buffer_count``, ``pipeline_read``,
  ``pipeline_write`` and the ``aio`` section set ``ZeroConfig.nvme``
  (``_ds_nvme``), and have no effect with another device.
  ``offload_param.device: "nvme"`` is an error (parameters on NVMe are not
  implemented). The deprecated ``cpu_offload`` / ``cpu_offload_param``
  switches still map to offload, with a warning, as DeepSpeed still
  honours them. ``ratio`` below 1 warns, as all of the state is
  offloaded.
* ``activation_checkpointing`` configures DeepSpeed's checkpointing API,
  which the model's code calls; zero_jax remats every layer of
  ``scan_layers`` by default (``remat="full"``). ``partition_activations``
  maps to ``"full"``: each layer keeps only its inputs, which are split
  over ``data`` with the batch already (DeepSpeed splits them over a
  tensor-parallel group, which zero_jax does not have).
  ``cpu_checkpointing`` maps to ``"offload_to_host"``, which moves the
  activations tagged with ``zero_jax.checkpoint_name`` to host memory: pass
  ``remat_names``.
* Monitors and other switched sections (``tensorboard``, ``wandb``,
  ``amp``, ``flops_profiler``...) are accepted when disabled; enabled, they
  are refused with the fix.
* Keys without effect (``NO_EFFECT_KEYS``: bucket sizes, logging, libaio
  details...) are accepted with one warning giving the reason of each.
* Everything else (``pipeline``, ``moe``, unknown keys...) is refused with
  a ``ValueError`` naming the dotted key and what to do instead; with
  ``unsupported="warn"`` each becomes a ``UserWarning`` and is dropped.
  ``from_deepspeed`` refuses ``optimizer`` and ``scheduler`` (it returns a
  ``ZeroConfig`` only); ``zero_jax.initialize`` builds them.
"""


from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Mapping

from zero_jax.config._config import ZeroConfig, nest
from zero_jax.config._ds_auto import (autos_left, check_known, fill_autos,
                                     with_aliases_read)
from zero_jax.config._ds_translate import Translator

_MODES = ("error", "warn")


def _load_config(config: Any) -> tuple[Mapping[str, Any], str | None]:
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


@dataclasses.dataclass(frozen=True)
class DeepSpeedConfig:
  """A DeepSpeed config as zero_jax reads it (``read_deepspeed``).

  Attributes:
    zero: the ``ZeroConfig`` translated from it.
    optimizer: its ``optimizer`` section, with every ``"auto"`` filled in
      (None when absent).
    scheduler: its ``scheduler`` section, likewise.
  """

  zero: ZeroConfig
  optimizer: Mapping[str, Any] | None = None
  scheduler: Mapping[str, Any] | None = None


def read_deepspeed(config: str | os.PathLike | Mapping[str, Any], *,
                   unsupported: str = "error",
                   optimizer: bool = True,
                   loss_scope: str = "global",
                   **known: Any) -> DeepSpeedConfig:
  """Reads a DeepSpeed config: its ``ZeroConfig`` and its optimizer and
  scheduler sections, with every ``"auto"`` filled in.

  What ``zero_jax.initialize`` reads a config with; ``from_deepspeed`` is
  this with ``optimizer=False``.

  Args:
    config: path to a DeepSpeed JSON file, or the already-parsed dict.
    unsupported: ``"error"`` (default) raises on keys that are unknown, or
      known to DeepSpeed but not honoured by zero_jax; ``"warn"`` issues one
      ``UserWarning`` per such key and drops it.
    optimizer: whether the ``optimizer`` and ``scheduler`` sections are
      returned (True) or refused as unsupported keys (False).
    loss_scope: ``ZeroConfig.loss_scope``, which DeepSpeed's JSON has no
      key for: ``"global"`` (default, one device's meaning) or
      ``"per_device"`` (DeepSpeed's; needed for ``zero_quantized_gradients``
      and for a float32 ``communication_data_type`` with 16-bit compute).
    **known: the values that fill in ``"auto"``, named as HuggingFace's
      Trainer names them (``AUTO_KEYWORDS``).

  Returns:
    The config read.

  Raises:
    ValueError: a value has the wrong type, an ``"auto"`` is left that no
      keyword given fills (all are listed), a keyword contradicts the
      config, fp16 and bf16 are both enabled, NVMe offload lacks its
      ``nvme_path`` or asks for parameters on NVMe, the file is not valid
      JSON, or (with ``unsupported="error"``) a key is
      not supported; the message names the dotted key and the fix.
    FileNotFoundError: ``config`` is a path that does not exist.
    TypeError: ``config`` is neither a path nor a mapping, or a keyword is
      not one of ``AUTO_KEYWORDS``.
  """
  if unsupported not in _MODES:
    raise ValueError(f"unsupported must be one of {_MODES}, got "
                     f"{unsupported!r}")
  check_known(known)
  data, path = _load_config(config)
  source = f" {path!r}" if path is not None else ""
  translator = Translator(unsupported, known, optimizer)
  try:
    data = with_aliases_read(data)
    skip = () if optimizer else ("optimizer", "scheduler")
    problems = fill_autos(data, known, skip)
    sections = [k for k in skip if k in data]
    if problems and sections:
      # One error for both (zj.initialize reads the sections): the
      # sections' "auto" values too, with their keywords.
      problems = fill_autos(data, known, ())
    if problems:
      raise ValueError(autos_left(source, problems, sections))
    translator.top(data)
  except ValueError as e:
    if path is None or repr(path) in str(e):
      raise
    raise ValueError(f"{e} (in {path!r})") from None
  translator.finish(source)
  try:
    # (Built in the nested form, each key in its section.)
    zero = ZeroConfig(**nest({**translator.kwargs,
                              "loss_scope": loss_scope}))
  except ValueError as e:
    sources = [f"{field} is {key!r}" for field, key in
               translator.sources.items()
               if re.search(rf"\b{field}\b", str(e))]
    if "loss_scope='per_device'" in str(e):
      sources.append("loss_scope is the loss_scope= keyword of "
                     "from_deepspeed and zero_jax.initialize")
    raise ValueError(
        f"DeepSpeed config{source} gives an invalid ZeroConfig: {e}" +
        (f" (in DeepSpeed's terms: {'; '.join(sources)})" if sources else "")
    ) from None
  return DeepSpeedConfig(zero, translator.optimizer, translator.scheduler)


def from_deepspeed(config: str | os.PathLike | Mapping[str, Any], *,
                   unsupported: str = "error", loss_scope: str = "global",
                   **known: Any) -> ZeroConfig:
  """Translates a DeepSpeed JSON config into a ``ZeroConfig``.

  ``MAPPING`` lists the keys translated and how (``mapping_table_markdown``
  renders it, ``key_list_markdown`` every key); the module docstring says
  what happens to the others. ``optimizer`` and ``scheduler`` are refused:
  ``zero_jax.initialize`` builds them.

  Args:
    config: path to a DeepSpeed JSON file, or the already-parsed dict.
    unsupported: ``"error"`` (default) raises on keys that are unknown, or
      known to DeepSpeed but not honoured by zero_jax; ``"warn"`` issues one
      ``UserWarning`` per such key and drops it.
    loss_scope: ``ZeroConfig.loss_scope`` (see ``read_deepspeed``).
    **known: the values that fill in ``"auto"``, named as HuggingFace's
      Trainer names them (``AUTO_KEYWORDS``: ``per_device_train_batch_size``,
      ``gradient_accumulation_steps``, ``max_grad_norm``, ``fp16``, ``bf16``,
      ``hidden_size``...). A batch size the other two determine stays None:
      ``ZeroConfig.batch_sizes`` derives it on the mesh's device count.

  Returns:
    The config. Batch sizes are copied as given; ``ZeroConfig.batch_sizes``
    resolves them once the device count is known.

  Raises:
    ValueError: a value has the wrong type, an ``"auto"`` is left unfilled
      (all are listed, each with the keyword that fills it; with
      ``optimizer`` or ``scheduler`` sections, theirs too, and the message
      names ``zero_jax.initialize``, which reads them), fp16 and bf16
      are both enabled, NVMe offload lacks its ``nvme_path`` or asks for
      parameters on NVMe, the file is not valid JSON, or (with
      ``unsupported="error"``) a key is not supported; the message names
      the dotted key.
    FileNotFoundError: ``config`` is a path that does not exist.
    TypeError: ``config`` is neither a path nor a mapping, or a keyword is
      unknown.
  """
  return read_deepspeed(config, unsupported=unsupported, optimizer=False,
                        loss_scope=loss_scope, **known).zero
