"""HuggingFace's ``"auto"`` values, filled in, and DeepSpeed's field-name
aliases, read.

HuggingFace's Trainer fills a DeepSpeed config's ``"auto"`` from its own
arguments; ``fill_autos`` does the same from keywords named as the Trainer
names them (``AUTO_KEYWORDS``), leaves a batch size the other two determine
to ``ZeroConfig.batch_sizes``, drops an ``"auto"`` in a key without effect,
and reports every ``"auto"`` left (and every keyword that contradicts the
config) at once. ``with_aliases_read`` renames DeepSpeed's pydantic field
names to the aliases the key tables use.
"""

from __future__ import annotations

import copy
import math
import re
from typing import Any, Mapping

from zero_jax.config._ds_keys import (ALIASES, ANY, NO_EFFECT_KEYS, SWITCHED,
                                     UNSUPPORTED_WHY, is_auto, key_name)
from zero_jax.config._ds_nvme import nvme_only

# The keywords that fill in "auto", named as HuggingFace's Trainer names the
# values it fills them from, and what each fills.
AUTO_KEYWORDS: Mapping[str, str] = {
    "per_device_train_batch_size": "train_micro_batch_size_per_gpu (and "
                                   "train_batch_size, with the devices)",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "max_grad_norm": "gradient_clipping",
    "learning_rate": "optimizer.params.lr, scheduler.params.warmup_max_lr",
    "adam_beta1": "optimizer.params.betas[0]",
    "adam_beta2": "optimizer.params.betas[1]",
    "adam_epsilon": "optimizer.params.eps",
    "weight_decay": "optimizer.params.weight_decay",
    "warmup_steps": "scheduler.params.warmup_num_steps",
    "warmup_ratio": "scheduler.params.warmup_num_steps (ratio x max_steps, "
                    "rounded up; when warmup_steps is not given)",
    "max_steps": "scheduler.params.total_num_steps",
    "fp16": "fp16.enabled",
    "bf16": "bf16.enabled",
    "hidden_size": "zero_optimization.stage3_param_persistence_threshold "
                   "(10 x hidden_size, at stage 3)",
    "remat_names": "the checkpoint_name tags activation_checkpointing."
                   "cpu_checkpointing moves to host (not an \"auto\")",
}

MISSING = object()
_TRIPLE = ("train_batch_size", "train_micro_batch_size_per_gpu",
           "gradient_accumulation_steps")

def with_aliases_read(data: Mapping[str, Any]) -> dict[str, Any]:
  """A copy of ``data`` with DeepSpeed's field names renamed to the aliases
  the tables use; both given is an error."""
  data = copy.deepcopy(dict(data))
  for name, alias in ALIASES.items():
    section, _, leaf = name.rpartition(".")
    parent = data.get(section) if section else data
    if not isinstance(parent, dict) or leaf not in parent:
      continue
    alias_leaf = alias.rpartition(".")[2]
    if alias_leaf in parent:
      raise ValueError(
          f"{key_name(name)} and {key_name(alias)} are the same DeepSpeed "
          f"setting (a field and its alias); keep one of them")
    parent[alias_leaf] = parent.pop(leaf)
  return data


def _at(data: Mapping[str, Any], path: str) -> Any:
  """The value at dotted ``path`` (None when absent)."""
  node: Any = data
  for part in path.split("."):
    if not isinstance(node, Mapping):
      return None
    node = node.get(part)
  return node


def _set(data: dict[str, Any], path: str, value: Any) -> None:
  """Sets dotted ``path``, or removes it for ``MISSING``."""
  *sections, leaf = path.split(".")
  node = data
  for part in sections:
    node = node[part]
  if value is MISSING:
    del node[leaf]
  else:
    node[leaf] = value


def check_known(known: Mapping[str, Any]) -> None:
  unknown = sorted(set(known) - set(AUTO_KEYWORDS))
  if unknown:
    raise TypeError(
        f"unknown keyword(s) {unknown}: the values that fill in a DeepSpeed "
        f"config's \"auto\" are named as HuggingFace's Trainer names them: "
        f"{sorted(AUTO_KEYWORDS)}")


def _warmup_steps(known: Mapping[str, Any]) -> Any:
  if known.get("warmup_steps") is not None:
    return known["warmup_steps"]
  if known.get("warmup_ratio") is not None and known.get(
      "max_steps") is not None:
    return math.ceil(known["warmup_ratio"] * known["max_steps"])
  return MISSING


def _fill(path: str, known: Mapping[str, Any]) -> tuple[Any, str, bool]:
  """What fills an "auto" at ``path``: (value or MISSING, the keyword(s)
  that give it, whether a written value must agree with it)."""
  simple = {"train_micro_batch_size_per_gpu": "per_device_train_batch_size",
            "gradient_accumulation_steps": "gradient_accumulation_steps",
            "gradient_clipping": "max_grad_norm",
            "optimizer.params.lr": "learning_rate",
            "optimizer.params.eps": "adam_epsilon",
            "optimizer.params.weight_decay": "weight_decay",
            "scheduler.params.warmup_max_lr": "learning_rate",
            "scheduler.params.total_num_steps": "max_steps",
            "fp16.enabled": "fp16", "bf16.enabled": "bf16",
            "bfloat16.enabled": "bf16"}
  if path in simple:
    word = simple[path]
    return known.get(word, MISSING) if known.get(
        word) is not None else MISSING, word, True
  if path == "optimizer.params.betas":
    b1, b2 = known.get("adam_beta1"), known.get("adam_beta2")
    value = [b1, b2] if b1 is not None and b2 is not None else MISSING
    return value, "adam_beta1 and adam_beta2", True
  if path == "scheduler.params.warmup_min_lr":
    return 0, "", False  # (the Trainer writes 0)
  if path == "scheduler.params.warmup_num_steps":
    return (_warmup_steps(known),
            "warmup_steps (or warmup_ratio with max_steps)", True)
  if path == "amp.enabled":
    return False, "", False  # (Apex only: zero_jax has none)
  if path == "zero_optimization.stage3_param_persistence_threshold":
    h = known.get("hidden_size")
    return (MISSING if h is None else 10 * h), "hidden_size", False
  return MISSING, "", False


def _autos(node: Any, prefix: str) -> list[str]:
  """The dotted paths of the "auto" values under ``node``."""
  out = []
  if isinstance(node, Mapping):
    for key, value in node.items():
      if is_auto(value):
        out.append(prefix + key)
      else:
        out += _autos(value, f"{prefix}{key}.")
  return out


def _is_on(data: Mapping[str, Any], section: str) -> bool:
  value = _at(data, section + ".enabled")
  return value is True


def fill_autos(data: dict[str, Any], known: Mapping[str, Any],
                skip: tuple[str, ...]) -> list[str]:
  """Fills in every "auto" of ``data`` that the keywords or the other
  values determine; returns the problems (one line each): the "auto"
  values left, and keywords that contradict the config."""
  problems = []
  # Keywords against the values the config writes (the Trainer's check).
  for path in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
               "gradient_clipping", "optimizer.params.lr",
               "optimizer.params.betas", "optimizer.params.eps",
               "optimizer.params.weight_decay",
               "scheduler.params.warmup_max_lr",
               "scheduler.params.warmup_num_steps",
               "scheduler.params.total_num_steps", "fp16.enabled",
               "bf16.enabled"):
    if path.split(".")[0] in skip:
      continue
    written = _at(data, path)
    value, words, must_match = _fill(path, known)
    if (written is None or is_auto(written) or value is MISSING or
        not must_match):
      continue
    same = (list(written) == list(value) if isinstance(written, list)
            and isinstance(value, list) else written == value)
    if not same:
      given = (f"{words}={value!r} was passed" if words in AUTO_KEYWORDS
               else f"{words} give {value!r}")
      problems.append(
          f"  {path!r} is {written!r} but {given}: make them agree, or "
          f"write \"auto\" in the config")
  # Top-level sections refused as a whole are not read (their refusal says
  # so); nor is what the caller does not read.
  readable = [k for k in data if k not in skip and (
      k in SWITCHED or k in _READ_SECTIONS or k not in UNSUPPORTED_WHY)]
  autos = [p for k in readable for p in (
      [k] if is_auto(data[k]) else _autos(data[k], k + "."))]
  left = []
  for path in autos:
    value, words, _ = _fill(path, known)
    if value is not MISSING:
      _set(data, path, value)
    elif path not in _TRIPLE:
      left.append((path, words))
  # With the fills in: the batch sizes, then what depends on switches.
  for path, words in list(left):
    if _needs_no_value(data, path):
      _set(data, path, MISSING)  # (read as absent)
      left.remove((path, words))
  train, micro, accum = (data.get(k) for k in _TRIPLE)
  number = lambda v: v is not None and not is_auto(v)  # noqa: E731
  triple_left = []
  if is_auto(train) and not number(micro):
    triple_left.append((_TRIPLE[0], "per_device_train_batch_size and "
                        "gradient_accumulation_steps (train_batch_size is "
                        "derived from them and the device count)"))
  if is_auto(micro) and not number(train):
    triple_left.append((_TRIPLE[1], "per_device_train_batch_size"))
  if is_auto(accum) and not (number(train) and number(micro)):
    triple_left.append((_TRIPLE[2], "gradient_accumulation_steps"))
  if not triple_left:
    for key in _TRIPLE:
      if is_auto(data.get(key)):
        data[key] = None  # (derived by ZeroConfig.batch_sizes)
  for path, words in triple_left + left:
    how = f"pass {_with_values(words)}" if words else "no keyword fills it"
    problems.append(f"  {path!r}: {how}, or replace 'auto' with a value")
  return problems


def _with_values(words: str) -> str:
  """``words`` with ``=...`` after each keyword it names: "adam_beta1 and
  adam_beta2" -> "adam_beta1=... and adam_beta2=..."."""
  return re.sub(rf"\b({'|'.join(AUTO_KEYWORDS)})\b", r"\1=...", words)


def autos_left(source: str, problems: list[str],
               sections: list[str]) -> str:
  """The error for the "auto" values left (``fill_autos``'s problems) of
  the config read from ``source``; ``sections``: the ``optimizer`` and
  ``scheduler`` sections it has that ``from_deepspeed`` does not read,
  which ``zero_jax.initialize`` reads (and fills) too."""
  many = "s" if len(problems) > 1 else ""
  head = (f"DeepSpeed config{source} has {len(problems)} \"auto\" value"
          f"{many} or keyword{many} to fix")
  if sections:
    names = " and ".join(repr(k) for k in sections)
    one = len(sections) == 1
    head += (f", and {'an ' * one}{names} section{'s' * (not one)}, which "
             "from_deepspeed does not read (it makes a ZeroConfig only). "
             "zj.initialize(loss_fn, params, config, **keywords) handles "
             "both: it fills the \"auto\" values from the keywords, and "
             "builds the optimizer and its schedule from "
             f"{'that section' if one else 'those sections'}")
  return (head + ". HuggingFace's Trainer fills \"auto\" from its "
          "arguments; pass them as keywords named as it names them:\n" +
          "\n".join(problems))


# Sections the translator reads key by key.
_READ_SECTIONS = ("fp16", "bf16", "bfloat16", "data_types",
                  "zero_optimization", "activation_checkpointing",
                  "optimizer", "scheduler", "amp")


def _needs_no_value(data: Mapping[str, Any], path: str) -> bool:
  """Whether an "auto" at ``path`` has no effect: a key without effect, a
  key of a disabled section, an NVMe key without NVMe offload, or stage
  3's threshold below stage 3."""
  if path in NO_EFFECT_KEYS and NO_EFFECT_KEYS[path][1] is ANY:
    return True
  if nvme_only(path):
    device = _at(data, "zero_optimization.offload_optimizer.device")
    return not (isinstance(device, str) and
                device.strip().lower() == "nvme")
  section, _, leaf = path.partition(".")
  if (section in SWITCHED or section == "amp") and leaf != "enabled" and (
      not _is_on(data, section)):
    return True
  if section == "fp16" and leaf != "enabled" and not _is_on(data, "fp16"):
    return True
  if path == "zero_optimization.stage3_param_persistence_threshold":
    stage = _at(data, "zero_optimization.stage")
    return stage in (0, 1, 2)
  return False
