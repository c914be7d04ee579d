"""DeepSpeed's NVMe offload keys (offload_optimizer.device "nvme", its
options and the aio section) translate to ZeroConfig's NVMe tier, or fail
naming the key."""

import copy
import json
import pathlib
import re
import warnings

import pytest

import zero_jax as zj
from zero_jax import config as zconfig
from zero_jax.config import _ds_keys as deepspeed_keys
from zero_jax.config import _ds_mapping as ds_mapping

_ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
_OPT = "zero_optimization.offload_optimizer."
# (A DeepSpeed config starts its swap files afresh, as DeepSpeed does.)
_DEFAULT = zconfig.NvmeOptions(resume=False)


def _example(**offload):
  """experiments/ds_config.json (the user's config) with the optimizer
  state on NVMe, and ``offload`` added to offload_optimizer."""
  config = json.loads((_ROOT / "experiments" / "ds_config.json").read_text(
      encoding="utf-8"))
  config["zero_optimization"]["offload_optimizer"].update(
      device="nvme", **offload)
  return config


def _nvme(zero=None, aio=None, **offload):
  """A stage 3 config with the optimizer state on NVMe."""
  config = {"zero_optimization": {"stage": 3, "offload_optimizer": dict(
      {"device": "nvme", "nvme_path": "/local_nvme"}, **offload), **(
          zero or {})}}
  if aio is not None:
    config["aio"] = aio
  return config


def _read(config, **kw):
  """from_deepspeed and the text of its warnings."""
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    cfg = zj.from_deepspeed(config, **kw)
  return cfg, "\n".join(str(w.message) for w in record)


def _key(path):
  return re.escape(repr(path))


def test_the_users_config_on_nvme_updates_on_the_host():
  cfg, text = _read(_example())
  assert cfg.offload_optimizer == "nvme"
  assert cfg.nvme_path == "/local_nvme/deepspeed"
  assert cfg.update_on == "host"
  assert cfg.nvme == _DEFAULT
  assert (cfg.stage, cfg.compute_dtype) == (2, "float16")
  # The notes: the host update, and the overlap DeepSpeed does not do by
  # default.
  assert "update_on=\"host\"" in text and "on the host" in text
  assert "pipeline_read" in text and "pipeline_write" in text
  assert "results are identical" in text
  assert "resume=False" in text and "NvmeOptions(resume=True)" in text
  # "cpu" keeps today's mapping, nvme_path without effect.
  config = _example()
  config["zero_optimization"]["offload_optimizer"]["device"] = "cpu"
  cfg, text = _read(config)
  assert (cfg.offload_optimizer, cfg.update_on, cfg.nvme_path) == (
      "host", "device", None)
  assert not text


def test_every_nvme_key_maps_to_its_field():
  config = _nvme(buffer_count=2, pipeline_read=False, pipeline_write=False,
                 aio={"block_size": 1048576, "queue_depth": 16,
                      "intra_op_parallelism": 2})
  with pytest.warns(UserWarning) as record:
    cfg = zj.from_deepspeed(config)
  assert cfg.nvme == zconfig.NvmeOptions(
      buffer_count=2, read_ahead=False, write_behind=False,
      block_bytes=1048576, in_flight=32, resume=False)
  # Both pipeline keys given: only the notes about the host update and
  # the files written afresh.
  notes = [str(r.message) for r in record]
  assert len(notes) == 2, notes
  assert any("update_on" in n for n in notes), notes
  assert any("resume=False" in n for n in notes), notes
  cfg, _ = _read(_nvme(pipeline_read=True, pipeline_write=True))
  assert cfg.nvme.read_ahead and cfg.nvme.write_behind


@pytest.mark.parametrize("offload,aio,field,value", [
    ({"buffer_count": 7}, None, "buffer_count", 7),
    ({"buffer_count": 1.0}, None, "buffer_count", 1),
    ({"pipeline_read": False}, None, "read_ahead", False),
    ({"pipeline_write": False}, None, "write_behind", False),
    ({}, {"block_size": 65536}, "block_bytes", 65536),
    # in_flight = intra_op_parallelism x queue_depth, DeepSpeed's default
    # (8 and 1) for the one absent.
    ({}, {"queue_depth": 4}, "in_flight", 4),
    ({}, {"intra_op_parallelism": 2}, "in_flight", 16),
    ({}, {"thread_count": 3}, "in_flight", 24),
    ({}, {"num_threads": 4, "queue_depth": 2}, "in_flight", 8),
    ({}, {"intra_op_parallelism": 2, "thread_count": 2, "num_threads": 2,
          "queue_depth": 32}, "in_flight", 64),
])
def test_each_key_sets_its_field_alone(offload, aio, field, value):
  cfg, _ = _read(_nvme(aio=aio, **offload))
  assert cfg.nvme == zconfig.NvmeOptions(**{field: value}, resume=False)


def test_absent_aio_keeps_zero_jax_defaults():
  cfg, _ = _read(_nvme(aio={"single_submit": False}))
  assert cfg.nvme.in_flight == _DEFAULT.in_flight
  assert cfg.nvme.block_bytes == _DEFAULT.block_bytes


def test_aliases_with_different_values_error_naming_both():
  for mode in ("error", "warn"):
    with pytest.raises(ValueError, match=(
        f"{_key('aio.intra_op_parallelism')} \\(2\\) and "
        f"{_key('aio.thread_count')} \\(4\\).*keep one")):
      zj.from_deepspeed(_nvme(aio={"intra_op_parallelism": 2,
                                   "thread_count": 4}), unsupported=mode)
  with pytest.raises(ValueError, match=_key("aio.num_threads")):
    zj.from_deepspeed(_nvme(aio={"thread_count": 1, "num_threads": 8}))


def test_missing_nvme_path_errors_naming_the_key():
  for path in (None, "absent"):
    config = _nvme()
    if path is None:
      config["zero_optimization"]["offload_optimizer"]["nvme_path"] = None
    else:
      del config["zero_optimization"]["offload_optimizer"]["nvme_path"]
    for mode in ("error", "warn"):
      with pytest.raises(ValueError, match=(
          f"{_key(_OPT + 'nvme_path')} is missing.*directory")):
        zj.from_deepspeed(config, unsupported=mode)
  with pytest.raises(ValueError, match=_key(_OPT + "nvme_path")):
    zj.from_deepspeed(_nvme(nvme_path=7))
  blank = f"nvme_path is {_key(_OPT + 'nvme_path')}"
  with pytest.raises(ValueError, match=blank), warnings.catch_warnings():
    warnings.simplefilter("ignore")  # (the notes come first)
    zj.from_deepspeed(_nvme(nvme_path="  "))


def test_parameters_on_nvme_are_refused_with_the_fix():
  config = {"zero_optimization": {"stage": 3, "offload_param": {
      "device": "nvme", "nvme_path": "/local_nvme"}}}
  for mode in ("error", "warn"):
    with pytest.raises(ValueError) as info:
      zj.from_deepspeed(config, unsupported=mode)
    message = str(info.value)
    assert repr("zero_optimization.offload_param.device") in message
    assert "not implemented" in message and "\"cpu\"" in message
    assert "offload_optimizer.device \"nvme\"" in message
  with pytest.raises(ValueError, match="\"cpu\" or \"none\""):
    zj.from_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {
        "device": "disk"}}})
  with pytest.raises(ValueError, match="\"cpu\" or \"nvme\" or \"none\""):
    zj.from_deepspeed(_nvme(device="disk"))


def test_gpudirect_storage_is_refused_and_false_accepted():
  config = _nvme(aio={"use_gds": True})
  with pytest.raises(ValueError, match="(?s)aio.use_gds: GPUDirect.*host RAM"):
    zj.from_deepspeed(config)
  cfg, text = _read(config, unsupported="warn")
  assert cfg.offload_optimizer == "nvme"
  assert "'aio.use_gds' is not supported" in text
  cfg, text = _read(_nvme(aio={"use_gds": False}))
  assert cfg.offload_optimizer == "nvme" and "aio.use_gds" in text


def test_keys_without_effect_are_accepted_with_their_reasons():
  cfg, text = _read(_nvme(fast_init=True, pin_memory=True,
                          aio={"single_submit": True,
                               "overlap_events": False}))
  assert cfg.nvme == _DEFAULT and cfg.offload_optimizer == "nvme"
  assert "aio.single_submit has no effect" in text
  assert "aio.overlap_events has no effect" in text
  assert "libaio" in text
  # Options of the offload that happens are accepted quietly, as with
  # "cpu"; their reasons are in the key list.
  assert "fast_init" not in text and "pin_memory" not in text
  why = deepspeed_keys.NO_EFFECT_KEYS[_OPT + "fast_init"][2]
  assert "one streamed pass" in why
  # ds_nvme_tune writes these two as strings.
  cfg, _ = _read(_nvme(aio={"single_submit": "false",
                            "overlap_events": "true"}))
  with pytest.raises(ValueError, match=_key("aio.single_submit")):
    zj.from_deepspeed(_nvme(aio={"single_submit": "yes"}))


@pytest.mark.parametrize("offload,aio,key,words", [
    ({}, {"block_size": 5000}, "aio.block_size", "multiple of 4096"),
    ({}, {"block_size": 1024}, "aio.block_size", ">= 4096"),
    ({}, {"block_size": 0}, "aio.block_size", ">= 1"),
    ({}, {"queue_depth": "8"}, "aio.queue_depth", "without quotes"),
    ({}, {"thread_count": 0}, "aio.thread_count", ">= 1"),
    ({}, {"queue_depth": 128, "intra_op_parallelism": 16},
     "aio.intra_op_parallelism", "1024"),
    ({"buffer_count": 0}, None, _OPT + "buffer_count", ">= 1"),
    ({"pipeline_read": 1}, None, _OPT + "pipeline_read", "true or false"),
])
def test_bad_values_error_naming_the_deepspeed_key(offload, aio, key,
                                                     words):
  for mode in ("error", "warn"):
    with pytest.raises(ValueError) as info:
      zj.from_deepspeed(_nvme(aio=aio, **offload), unsupported=mode)
    assert repr(key) in str(info.value) and words in str(info.value)


def test_without_nvme_the_nvme_keys_have_no_effect():
  aio = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1,
         "num_threads": 1, "single_submit": False, "overlap_events": True,
         "use_gds": True}
  for device in ("cpu", "none"):
    config = _nvme(device=device, buffer_count=5, pipeline_read=True,
                   pipeline_write=False, fast_init=True, aio=aio)
    cfg, text = _read(config)
    assert cfg.nvme == zconfig.NvmeOptions() and cfg.nvme_path is None
    assert cfg.offload_optimizer == ("host" if device == "cpu" else None)
    # The aio section: one warning naming its keys; offload_optimizer's
    # options stay quiet, as before.
    assert text.count("has no effect") == 1
    assert "'aio' (aio.block_size, aio.queue_depth" in text
    assert "aio.use_gds" in text and "buffer_count" not in text
  cfg, text = _read({"aio": aio})
  assert cfg.offload_optimizer is None and "'aio'" in text
  # The keys are still checked, and unknown ones refused.
  with pytest.raises(ValueError, match=_key("aio.queue_depth")):
    zj.from_deepspeed({"aio": {"queue_depth": -1}})
  with pytest.raises(ValueError, match=_key(_OPT + "buffer_count")):
    zj.from_deepspeed(_nvme(device="cpu", buffer_count="4"))
  for config in ({"aio": {"block_sise": 4096}},
                 _nvme(aio={"block_sise": 4096})):
    with pytest.raises(ValueError, match="aio.block_sise: not a DeepSpeed"):
      zj.from_deepspeed(config)


def test_auto_in_nvme_keys_needs_a_value_only_with_nvme():
  config = _nvme(device="cpu", buffer_count="auto",
                 aio={"block_size": "auto"})
  cfg, _ = _read(config)
  assert cfg.nvme == zconfig.NvmeOptions()
  with pytest.raises(ValueError, match="'aio.block_size': no keyword"):
    zj.from_deepspeed(_nvme(aio={"block_size": "auto"}))
  with pytest.raises(ValueError, match=_key(_OPT + "buffer_count")):
    zj.from_deepspeed(_nvme(buffer_count="auto"))
  # A key without effect needs no value with NVMe too.
  cfg, _ = _read(_nvme(aio={"single_submit": "auto"}))
  assert cfg.offload_optimizer == "nvme"


def test_ratio_below_one_warns_with_nvme_too():
  cfg, text = _read(_nvme(ratio=0.5))
  assert cfg.offload_optimizer == "nvme"
  assert "not a fraction" in text


def test_no_nvme_key_is_dropped_silently():
  # Every NVMe key of DeepSpeed's schema is a row of the map (with its
  # field) or has a reason in the key tables: none is unknown.
  tables = ({row.key for row in ds_mapping.MAPPING} |
            set(deepspeed_keys.NO_EFFECT_KEYS))
  keys = [_OPT + leaf for leaf in (
      "device", "nvme_path", "buffer_count", "pipeline_read",
      "pipeline_write", "fast_init", "pin_memory", "ratio")] + [
          "aio." + leaf for leaf in (
              "block_size", "queue_depth", "intra_op_parallelism",
              "thread_count", "num_threads", "single_submit",
              "overlap_events", "use_gds")]
  assert not [k for k in keys if k not in tables and not k.endswith(
      ".ratio")]
  listed = zconfig.key_list_markdown()
  assert all(f"| `{k}` |" in listed for k in keys if k in tables)
  assert "| `aio` |" not in listed  # (each key of it is listed instead)
  # With NVMe: each key given changes the config or is in a warning.
  full = _nvme(buffer_count=2, pipeline_read=False, pipeline_write=False,
               fast_init=False, pin_memory=True, ratio=1.0,
               aio={"block_size": 4096, "queue_depth": 2,
                    "intra_op_parallelism": 3, "single_submit": False,
                    "overlap_events": True, "use_gds": False})
  cfg, text = _read(full)
  assert cfg.nvme == zconfig.NvmeOptions(
      buffer_count=2, read_ahead=False, write_behind=False,
      block_bytes=4096, in_flight=6, resume=False)
  for leaf in ("single_submit", "overlap_events", "use_gds"):
    assert "aio." + leaf in text
  # The rows' fields are ZeroConfig fields or shorthand, or NvmeOptions
  # fields under "nvme.".
  nvme_fields = set(zconfig.NvmeOptions.__dataclass_fields__)
  for row in ds_mapping.MAPPING:
    if row.field.startswith("nvme."):
      assert row.field[len("nvme."):] in nvme_fields, row.key
    elif row.field:
      assert (row.field in zj.ZeroConfig.__dataclass_fields__
              or row.field in zconfig.SHORTHAND), row.key


def test_the_translation_does_not_change_the_callers_dict():
  config = _nvme(buffer_count=2, aio={"queue_depth": 4})
  before = copy.deepcopy(config)
  _read(config)
  assert config == before
