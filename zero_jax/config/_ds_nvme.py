"""DeepSpeed's NVMe offload (ZeRO-Infinity's optimizer state on disk), read
into ``ZeroConfig``'s NVMe tier.

``zero_optimization.offload_optimizer.device: "nvme"`` reads as
``offload_optimizer="nvme"`` with ``update_on="host"`` and ``nvme_path``;
``offload_optimizer``'s ``buffer_count``, ``pipeline_read`` and
``pipeline_write`` and the ``aio`` section read as fields of
``ZeroConfig.nvme`` (an ``NvmeOptions``). The rows of ``MAPPING``
(``_ds_mapping``) say what each key sets; the ``Translator``
(``_ds_translate``) calls the readers here. With another device the keys
are checked and have no effect (the ``aio`` section's with a warning).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from zero_jax.config._ds_keys import NO_EFFECT_KEYS, key_name
from zero_jax.config._ds_mapping import ROWS, DeepSpeedKey
from zero_jax.config._nvme import NvmeOptions

_OPTIMIZER = "zero_optimization.offload_optimizer."
_AIO = "aio."
# offload_optimizer's keys that configure the NVMe tier.
_OPTIMIZER_LEAVES = ("nvme_path", "buffer_count", "pipeline_read",
                     "pipeline_write")
# aio.intra_op_parallelism and its other names: thread_count before
# DeepSpeed 0.16.4, num_threads as DeepNVMe's ds_nvme_tune writes it.
_PARALLELISM = ("intra_op_parallelism", "thread_count", "num_threads")
# DeepSpeed's defaults (deepspeed/runtime/swap_tensor/constants.py).
_DEFAULTS = {"queue_depth": 8, "intra_op_parallelism": 1}
_PIPELINE = {"pipeline_read": "read_ahead", "pipeline_write": "write_behind"}


def nvme_only(path: str) -> bool:
  """Whether the dotted key ``path`` takes effect only with
  ``offload_optimizer.device`` "nvme" (an ``"auto"`` there needs no value
  otherwise)."""
  return path.startswith(_AIO) or path in {
      _OPTIMIZER + leaf for leaf in _OPTIMIZER_LEAVES}


def _store(t: Any, row: DeepSpeedKey, value: Any, source: str) -> None:
  """Sets ``row``'s field: a ZeroConfig field, or (``"nvme.x"``) field x
  of the ``NvmeOptions`` that ``read_aio`` builds."""
  if row.field.startswith("nvme."):
    t.nvme[row.field[len("nvme."):]] = value
    t.nvme_keys[row.field[len("nvme."):]] = source
  else:
    t.set(row.field, value, row.key)


def read_optimizer(t: Any, section: Mapping[str, Any], device: str) -> set[str]:
  """Reads ``offload_optimizer``'s NVMe keys into translator ``t``: with
  ``device`` "nvme", ``offload_optimizer="nvme"``, ``update_on="host"``,
  ``nvme_path`` and the ``nvme`` fields; with another, it checks them only
  (no effect, as in DeepSpeed). Returns the keys read."""
  p = _OPTIMIZER
  for leaf in _OPTIMIZER_LEAVES:
    value = t.get(section, leaf, p)
    if value is None:
      continue
    row = ROWS[p + leaf]
    value = row.read(row.key, value)
    if device == "nvme":
      _store(t, row, value, key_name(row.key))
  if device != "nvme":
    return set(_OPTIMIZER_LEAVES)
  if t.get(section, "nvme_path", p) is None:
    raise ValueError(
        f"{key_name(p + 'nvme_path')} is missing: device \"nvme\" keeps the "
        "optimizer state in files under it; set it to a directory on a fast "
        "local disk (e.g. \"/local_nvme\"), or set device to \"cpu\" to keep "
        "the state in host memory")
  t.set("offload_optimizer", "nvme", p + "device")
  t.set("update_on", "host", p + "device")
  t.notes.append(
      f"'{p}device' is \"nvme\": read as offload_optimizer=\"nvme\" with "
      "update_on=\"host\": zero_jax's NVMe tier always updates the optimizer "
      "state on the host, a slice at a time as it streams between the files "
      "under nvme_path and host RAM (DeepSpeed's optimizer step runs on the "
      "CPU too)")
  t.nvme["resume"] = False
  t.notes.append(
      "DeepSpeed writes its NVMe swap files afresh at every start: read as "
      "NvmeOptions(resume=False), so a state committed under nvme_path by "
      "an earlier run is written over; to continue a run that was killed "
      "from its last committed step, pass zj.initialize a ZeroConfig with "
      "nvme=zero_jax.NvmeOptions(resume=True) (docs/offload.md)")
  absent = [leaf for leaf in _PIPELINE if section.get(leaf) is None]
  if absent:
    fields = "/".join(f"NvmeOptions.{_PIPELINE[leaf]}" for leaf in absent)
    t.notes.append(
        f"{' and '.join(repr(p + leaf) for leaf in absent)} "
        f"{'are' if len(absent) > 1 else 'is'} absent (DeepSpeed's default: "
        f"false): zero_jax keeps its default, true ({fields}): it overlaps "
        "reading and writing the state files with the update, and the "
        "results are identical; write false to wait for each instead")
  return set(_OPTIMIZER_LEAVES)


def read_aio(t: Any, section: Mapping[str, Any]) -> None:
  """Reads the ``aio`` section into translator ``t``: with
  ``offload_optimizer="nvme"`` its ``NvmeOptions`` (``ZeroConfig.nvme``,
  with the fields ``read_optimizer`` read); otherwise its keys are checked
  and have no effect (a warning says so)."""
  p = _AIO
  rows = {leaf: ROWS[p + leaf] for leaf in
          ("block_size", "queue_depth") + _PARALLELISM}
  if t.kwargs.get("offload_optimizer") != "nvme":
    accepted = []
    for leaf in section:
      value = t.get(section, leaf, p)
      if value is None:
        continue
      if leaf in rows:
        rows[leaf].read(p + leaf, value)
      elif p + leaf in NO_EFFECT_KEYS:
        NO_EFFECT_KEYS[p + leaf][0](p + leaf, value)
      else:
        t.unsupported(p + leaf)
        continue
      accepted.append(p + leaf)
    if accepted:
      t.notes.append(
          f"'aio' ({', '.join(accepted)}) has no effect: it configures NVMe "
          "offload, and zero_optimization.offload_optimizer.device is not "
          "\"nvme\"")
    return
  values = {}
  for leaf, row in rows.items():
    value = t.get(section, leaf, p)
    if value is not None:
      values[leaf] = row.read(row.key, value)
  if "block_size" in values:
    _store(t, rows["block_size"], values["block_size"],
           key_name(p + "block_size"))
  _in_flight(t, values)
  t.rest(section, p, set(rows))
  _build(t)


def _in_flight(t: Any, values: Mapping[str, int]) -> None:
  """``NvmeOptions.in_flight`` = intra_op_parallelism x queue_depth (the
  requests in flight), when either is given."""
  p = _AIO
  named = [(leaf, values[leaf]) for leaf in _PARALLELISM if leaf in values]
  if len({value for _, value in named}) > 1:
    keys = " and ".join(f"{p + leaf!r} ({value})" for leaf, value in named)
    raise ValueError(
        f"DeepSpeed config keys {keys} are one DeepSpeed setting "
        "(thread_count is intra_op_parallelism's name before DeepSpeed "
        "0.16.4, num_threads the name DeepNVMe's ds_nvme_tune writes) with "
        "different values; keep one of them: aio.intra_op_parallelism")
  if not named and "queue_depth" not in values:
    return
  if named:
    leaf, parallelism = named[0]
  else:
    leaf, parallelism = _PARALLELISM[0], _DEFAULTS[_PARALLELISM[0]]
  depth = values.get("queue_depth", _DEFAULTS["queue_depth"])
  if named and "queue_depth" in values:
    source = f"DeepSpeed config keys {p + leaf!r} x {p + 'queue_depth'!r}"
  elif named:
    source = (f"{key_name(p + leaf)} (x queue_depth {depth}, DeepSpeed's "
              "default)")
  else:
    source = (f"{key_name(p + 'queue_depth')} (x intra_op_parallelism "
              f"{parallelism}, DeepSpeed's default)")
  _store(t, ROWS[p + "queue_depth"], parallelism * depth, source)


def _build(t: Any) -> None:
  """Sets ``ZeroConfig.nvme`` from the fields read; an invalid one raises
  naming the DeepSpeed key that gave it."""
  if not t.nvme:
    return
  try:
    options = NvmeOptions(**t.nvme)
  except ValueError as e:
    match = re.search(r"NvmeOptions\.(\w+)", str(e))
    if match is None or match.group(1) not in t.nvme_keys:
      raise
    name = match.group(0)
    raise ValueError(str(e).replace(
        name, f"{t.nvme_keys[match.group(1)]} ({name})", 1)) from None
  t.kwargs["nvme"] = options
