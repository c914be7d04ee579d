"""DeepSpeed JSON configs translate to ZeroConfig, or fail naming the key."""

import json
import os
import re
import warnings

import pytest

import zero_jax as zj
from zero_jax import config as zconfig
from zero_jax.config import _deepspeed as deepspeed
from zero_jax.config import _ds_mapping as ds_mapping
from zero_jax.config import _ds_keys as deepspeed_keys

# The example config of the issue (DeepSpeed's ZeRO-Offload tutorial).
_EXAMPLE = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 8,
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {
            "device": "cpu",
            "nvme_path": "/local_nvme/deepspeed",
        },
    },
    "fp16": {"enabled": True},
    "gradient_accumulation_steps": 4,
}


def _load(config, **kw):
  """from_deepspeed, failing on any warning."""
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    return zj.from_deepspeed(config, **kw)


def _key(path):
  return re.escape(repr(path))


def test_issue_example_loads():
  cfg = _load(_EXAMPLE)
  assert cfg.stage == 2
  assert cfg.compute_dtype == "float16"
  assert cfg.dynamic_loss_scale
  assert (cfg.loss_scale, cfg.initial_scale_power, cfg.loss_scale_window,
          cfg.hysteresis, cfg.min_loss_scale) == (0.0, 16, 1000, 2, 1.0)
  assert not cfg.consecutive_hysteresis
  assert cfg.offload_optimizer == "host"
  assert cfg.reduce_dtype is None and cfg.clip_grad_norm is None
  assert cfg.batch_sizes(1) == (32, 8, 4)


def test_batch_sizes_are_copied_and_resolved_later():
  one = dict(_EXAMPLE, train_micro_batch_size_per_gpu=1)
  assert _load(one).batch_sizes(8) == (32, 1, 4)
  cfg = _load(_EXAMPLE)  # 8 x 4 x 8 != 32, but only batch_sizes checks
  with pytest.raises(ValueError, match="contradict"):
    cfg.batch_sizes(8)
  cfg = _load({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2})
  assert cfg.grad_accum_steps is None
  assert cfg.batch_sizes(8) == (64, 2, 4)


def test_loads_from_a_path(tmp_path):
  path = tmp_path / "ds_config.json"
  path.write_text(json.dumps(_EXAMPLE))
  assert _load(path) == _load(_EXAMPLE)
  assert _load(str(path)) == _load(_EXAMPLE)
  assert deepspeed.from_deepspeed(path) == _load(_EXAMPLE)


def test_bad_files_name_the_path(tmp_path):
  missing = tmp_path / "missing.json"
  with pytest.raises(FileNotFoundError, match="missing.json"):
    zj.from_deepspeed(missing)
  broken = tmp_path / "broken.json"
  broken.write_text('{"train_batch_size": 32,}')
  with pytest.raises(ValueError, match="broken.json.*not valid JSON"):
    zj.from_deepspeed(broken)
  array = tmp_path / "array.json"
  array.write_text("[1, 2]")
  with pytest.raises(ValueError, match="array.json.*JSON object"):
    zj.from_deepspeed(array)
  with pytest.raises(TypeError, match="path to a DeepSpeed JSON file"):
    zj.from_deepspeed(32)


def test_errors_from_a_file_name_it(tmp_path):
  path = tmp_path / "ds.json"
  path.write_text(json.dumps({"zero_optimization": {"stage": "2"}}))
  with pytest.raises(ValueError, match="zero_optimization.stage.*ds.json"):
    zj.from_deepspeed(path)
  path.write_text(json.dumps({"optimizer": {"type": "Adam"}}))
  with pytest.raises(ValueError, match="(?s)ds.json.*optimizer"):
    zj.from_deepspeed(path)


def test_defaults_are_deepspeeds():
  cfg = _load({})
  assert cfg.stage == 0  # DeepSpeed's default, not ZeroConfig's
  assert cfg.compute_dtype is None and cfg.offload_optimizer is None
  default = zj.ZeroConfig()
  assert cfg.min_shard_elements == default.min_shard_elements
  assert cfg.batch_sizes(8) == (None, None, 1)
  assert _load({"zero_optimization": False}).stage == 0
  assert _load({"zero_optimization": {}}).stage == 0
  assert _load({"zero_optimization": None}).stage == 0
  for stage in range(4):
    assert _load({"zero_optimization": {"stage": stage}}).stage == stage


def test_deprecated_zero_optimization_true_is_stage_1():
  with pytest.warns(UserWarning, match="deprecated"):
    assert zj.from_deepspeed({"zero_optimization": True}).stage == 1


def test_optimizer_offload_options_are_accepted():
  cfg = _load({"zero_optimization": {"stage": 3, "offload_optimizer": {
      "device": "cpu", "pin_memory": True, "buffer_count": 4,
      "fast_init": False, "ratio": 1.0, "nvme_path": None}}})
  assert cfg.offload_optimizer == "host"
  cfg = _load({"zero_optimization": {"stage": 1, "offload_optimizer": {
      "device": "none", "pin_memory": False}}})
  assert cfg.offload_optimizer is None
  with pytest.warns(UserWarning, match="ratio"):
    cfg = zj.from_deepspeed({"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})
  assert cfg.offload_optimizer == "host"
  assert _load({"zero_optimization": {"offload_param": {
      "device": "none"}}}).stage == 0


# One unsupported key of each kind: (config, dotted key, words of the reason).
_UNSUPPORTED = [
    ({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}}, "optimizer",
     "optax"),
    ({"scheduler": {"type": "WarmupLR", "params": {}}}, "scheduler", "optax"),
    ({"torch_autocast": {"enabled": True}}, "torch_autocast",
     "bf16.enabled"),
    ({"amp": {"enabled": True, "opt_level": "O3"}}, "amp.opt_level",
     "master weights"),
    ({"amp": {"enabled": True, "cast_model_type": "float16"}},
     "amp.cast_model_type", "compute_dtype"),
    ({"tensorboard": {"enabled": True}}, "tensorboard", "metrics"),
    ({"wandb": {"enabled": True}}, "wandb", "metrics"),
    ({"flops_profiler": {"enabled": True}}, "flops_profiler", "profiler"),
    ({"pipeline": {"stages": "auto"}}, "pipeline", "pipeline"),
    ({"moe": {"enabled": True}}, "moe", "mixture"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, "fp16.auto_cast",
     "loss_fn"),
    ({"data_types": {"grad_accum_dtype": "bf16"}},
     "data_types.grad_accum_dtype", "float32"),
    ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor",
     "pre-division"),
    ({"zero_optimization": {"stage": 3,
                            "zero_quantized_nontrainable_weights": True}},
     "zero_optimization.zero_quantized_nontrainable_weights", "ZeRO++"),
    ({"no_such_key": 1}, "no_such_key", "spelling"),
    ({"zero_optimization": {"stage": 2, "overlap_com": True}},
     "zero_optimization.overlap_com", "spelling"),
    ({"bf16": {"enabled": True, "loss_scale": 0}}, "bf16.loss_scale",
     "spelling"),
]


@pytest.mark.parametrize("config,key,why", _UNSUPPORTED,
                         ids=[k for _, k, _ in _UNSUPPORTED])
def test_unsupported_key_errors_naming_it(config, key, why):
  with pytest.raises(ValueError, match=re.escape(key)) as info:
    zj.from_deepspeed(config)
  message = str(info.value)
  assert why in message
  assert "unsupported='warn'" in message


@pytest.mark.parametrize("config,key,why", _UNSUPPORTED,
                         ids=[k for _, k, _ in _UNSUPPORTED])
def test_unsupported_key_warns_and_is_dropped(config, key, why):
  with pytest.warns(UserWarning, match=_key(key)) as record:
    cfg = zj.from_deepspeed(config, unsupported="warn")
  assert isinstance(cfg, zj.ZeroConfig)
  assert sum(repr(key) in str(w.message) for w in record) == 1


def test_every_unsupported_key_is_listed_once():
  config = {"optimizer": {}, "scheduler": {}, "wandb": {"enabled": True},
            "zero_optimization": {
                "stage": 3, "zero_quantized_nontrainable_weights": True}}
  with pytest.raises(ValueError, match="4 keys") as info:
    zj.from_deepspeed(config)
  for key in ("optimizer", "scheduler", "wandb",
              "zero_optimization.zero_quantized_nontrainable_weights"):
    assert f"  {key}: " in str(info.value)
  with pytest.warns(UserWarning) as record:
    cfg = zj.from_deepspeed(config, unsupported="warn")
  assert len(record) == 4
  assert cfg.stage == 3
  # The warnings point at the caller, not at zero_jax.
  assert all(w.filename == __file__ for w in record)


def test_zero_plus_plus_quantization_keys_map_to_config_fields():
  cfg = _load({"zero_optimization": {"stage": 3,
                                     "zero_quantized_weights": True}})
  assert cfg.quantized_weights and not cfg.quantized_gradients
  # qgZ quantizes each device's own gradient, which the default global
  # loss's compiler-made sums never hold: refused, naming the DeepSpeed key
  # and the fix, the loss_scope keyword, with which it maps.
  both = {"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                "zero_quantized_gradients": True}}
  with pytest.raises(ValueError, match=r"loss_scope='per_device'.*"
                     r"quantized_gradients is 'zero_optimization\."
                     r"zero_quantized_gradients'.*loss_scope= keyword"):
    zj.from_deepspeed(both)
  cfg = zj.from_deepspeed(both, loss_scope="per_device")
  assert cfg.quantized_weights and cfg.quantized_gradients
  assert cfg.loss_scope == "per_device"
  off = _load({"zero_optimization": {"stage": 2,
                                     "zero_quantized_weights": False}})
  assert not off.quantized_weights and not off.quantized_gradients
  # The stage rules are ZeroConfig's, named in the error.
  with pytest.raises(ValueError, match="quantized_weights needs stage=3"):
    zj.from_deepspeed({"zero_optimization": {
        "stage": 2, "zero_quantized_weights": True}})
  with pytest.raises(ValueError, match="zero_quantized_gradients"):
    zj.from_deepspeed({"zero_optimization": {
        "stage": 3, "zero_quantized_gradients": "yes"}})


def test_unsupported_mode_is_checked():
  with pytest.raises(ValueError, match="unsupported must be one of"):
    zj.from_deepspeed({}, unsupported="ignore")


def test_deepspeed_defaults_written_out_are_accepted():
  cfg = _load({"fp16": {"enabled": True, "auto_cast": False},
               "zero_optimization": {"stage": 2, "zero_hpz_partition_size":
                                     1, "ignore_unused_parameters": True},
               "data_types": {"grad_accum_dtype": "fp32"},
               "bf16": {"enabled": False}})
  assert cfg.compute_dtype == "float16" and cfg.stage == 2


@pytest.mark.parametrize("config,key", [
    ({"train_batch_size": "auto"}, "train_batch_size"),
    ({"gradient_accumulation_steps": "auto"}, "gradient_accumulation_steps"),
    ({"gradient_clipping": "auto"}, "gradient_clipping"),
    ({"fp16": {"enabled": "auto"}}, "fp16.enabled"),
    ({"bf16": {"enabled": "auto"}}, "bf16.enabled"),
    ({"zero_optimization": {"stage": 3,
                            "stage3_param_persistence_threshold": "auto"}},
     "zero_optimization.stage3_param_persistence_threshold"),
])
def test_auto_errors_naming_the_key(config, key):
  for mode in ("error", "warn"):
    with pytest.raises(ValueError, match=_key(key) + ".*replace 'auto'"):
      zj.from_deepspeed(config, unsupported=mode)


def test_fp16_and_bf16_together_error():
  with pytest.raises(ValueError, match="both fp16 and bf16"):
    zj.from_deepspeed({"fp16": {"enabled": True},
                                  "bf16": {"enabled": True}})
  with pytest.raises(ValueError, match="both fp16 and bfloat16"):
    zj.from_deepspeed({"fp16": {"enabled": True},
                                  "bfloat16": {"enabled": True}})
  with pytest.raises(ValueError, match="keep only 'bf16'"):
    zj.from_deepspeed({"bf16": {"enabled": True},
                                  "bfloat16": {"enabled": True}})


def test_bf16_maps():
  assert _load({"bf16": {"enabled": True}}).compute_dtype == "bfloat16"
  assert _load({"bfloat16": {"enabled": True}}).compute_dtype == "bfloat16"
  assert _load({"bf16": {"enabled": False}}).compute_dtype is None
  assert _load({"bf16": {}}).compute_dtype is None
  # DeepSpeed allows fp16 disabled next to bf16 enabled.
  cfg = _load({"bf16": {"enabled": True}, "fp16": {"enabled": False}})
  assert cfg.compute_dtype == "bfloat16" and not cfg.dynamic_loss_scale


def test_tuning_keys_warn_once():
  zero = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
          "reduce_scatter": True, "allgather_partitions": True,
          "reduce_bucket_size": 5e8, "allgather_bucket_size": 500000000,
          "stage3_prefetch_bucket_size": 5e7,
          "stage3_max_live_parameters": 1e9,
          "stage3_max_reuse_distance": 1e9, "sub_group_size": 1e9,
          "round_robin_gradients": False,
          "stage3_gather_16bit_weights_on_model_save": True,
          "elastic_checkpoint": False, "load_from_fp32_weights": True}
  top = {"steps_per_print": 10, "wall_clock_breakdown": False,
         "zero_allow_untested_optimizer": True, "dump_state": False,
         "prescale_gradients": True, "gradient_predivide_factor": 1.0}
  with pytest.warns(UserWarning, match="no effect in zero_jax") as record:
    cfg = zj.from_deepspeed(dict(top, zero_optimization=zero))
  assert len(record) == 1
  message = str(record[0].message)
  assert "XLA" in message
  for key in list(top) + [f"zero_optimization.{k}" for k in zero
                          if k != "stage"]:
    assert key in message
    assert key in deepspeed_keys.NO_EFFECT_KEYS
  assert "zero_optimization.stage," not in message
  assert cfg.stage == 3


def test_tuning_keys_not_given_are_not_listed():
  with pytest.warns(UserWarning) as record:
    zj.from_deepspeed({"steps_per_print": 100})
  assert len(record) == 1
  assert "steps_per_print has no effect" in str(record[0].message)
  assert "overlap_comm" not in str(record[0].message)


def test_fp16_keys_map():
  cfg = _load({"fp16": {"enabled": True, "loss_scale": 0,
                        "initial_scale_power": 12, "loss_scale_window": 500,
                        "hysteresis": 3, "min_loss_scale": 0.5,
                        "consecutive_hysteresis": True}})
  assert cfg.dynamic_loss_scale
  assert (cfg.initial_scale_power, cfg.loss_scale_window, cfg.hysteresis,
          cfg.min_loss_scale, cfg.consecutive_hysteresis) == (12, 500, 3, 0.5,
                                                              True)
  static = _load({"fp16": {"enabled": True, "loss_scale": 128}})
  assert static.loss_scale == 128.0 and not static.dynamic_loss_scale


def test_fp16_keys_are_ignored_when_fp16_is_off():
  cfg = _load({"fp16": {"enabled": False, "loss_scale": 128,
                        "initial_scale_power": "auto", "auto_cast": True},
               "bf16": {"enabled": True}})
  assert cfg.compute_dtype == "bfloat16" and cfg.loss_scale == 0
  assert _load({"fp16": {"loss_scale": 128}}).compute_dtype is None


def test_invalid_zero_config_names_the_deepspeed_key():
  with pytest.raises(ValueError, match="fp16.min_loss_scale"):
    zj.from_deepspeed({"fp16": {"enabled": True,
                                           "initial_scale_power": 4,
                                           "min_loss_scale": 64}})


@pytest.mark.parametrize("value,dtype", [
    ("fp32", "float32"), ("float32", "float32"), ("fp16", "float16"),
    ("float16", "float16"), ("bf16", "bfloat16"), ("bfloat16", "bfloat16")])
def test_communication_data_type_maps(value, dtype):
  # (With the compute dtype that the default global loss's compiler sums
  # in; other sums of 16-bit gradients are refused, below.)
  compute = {"float32": {}, "float16": {"fp16": {"enabled": True}},
             "bfloat16": {"bf16": {"enabled": True}}}[dtype]
  cfg = _load({"communication_data_type": value, **compute})
  assert cfg.reduce_dtype == dtype


@pytest.mark.parametrize("value", ["fp32", "float32", "fp16"])
def test_communication_data_type_other_than_bf16_compute_is_refused(value):
  """With bf16 compute, the default global loss's gradients are summed in
  bf16 by the compiler's reduce-scatter: another communication_data_type
  is refused, naming DeepSpeed's key and loss_scope='per_device' (whose
  16-bit gradients are summed in float32) as the fix."""
  config = {"communication_data_type": value, "bf16": {"enabled": True}}
  with pytest.raises(ValueError, match=r"loss_scope='per_device'.*"
                     r"reduce_dtype is 'communication_data_type'"):
    zj.from_deepspeed(config)
  assert zj.from_deepspeed(config, loss_scope="per_device").reduce_dtype == (
      {"fp16": "float16"}.get(value, "float32"))


def test_gradient_clipping():
  assert _load({"gradient_clipping": 0}).clip_grad_norm is None
  assert _load({"gradient_clipping": 0.0}).clip_grad_norm is None
  assert _load({}).clip_grad_norm is None
  assert _load({"gradient_clipping": 1.0}).clip_grad_norm == 1.0
  assert _load({"gradient_clipping": 2}).clip_grad_norm == 2.0


def test_persistence_threshold_maps():
  # DeepSpeed keeps leaves of <= threshold elements whole; zero_jax those of
  # < min_shard_elements.
  zero = {"stage": 3, "stage3_param_persistence_threshold": 1e5}
  cfg = _load({"zero_optimization": zero})
  assert cfg.min_shard_elements == 100_001
  zero["stage3_param_persistence_threshold"] = 0
  assert _load({"zero_optimization": zero}).min_shard_elements == 1


@pytest.mark.parametrize("config,key", [
    ({"zero_optimization": {"stage": "2"}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
    ({"zero_optimization": {"stage": 2.5}}, "zero_optimization.stage"),
    ({"zero_optimization": "stage2"}, "zero_optimization"),
    ({"fp16": {"enabled": "yes"}}, "fp16.enabled"),
    ({"fp16": "on"}, "fp16"),
    ({"bf16": {"enabled": 1}}, "bf16.enabled"),
    ({"train_batch_size": 0}, "train_batch_size"),
    ({"train_batch_size": -8}, "train_batch_size"),
    ({"train_batch_size": 32.5}, "train_batch_size"),
    ({"train_micro_batch_size_per_gpu": "8"},
     "train_micro_batch_size_per_gpu"),
    ({"gradient_accumulation_steps": 1.5}, "gradient_accumulation_steps"),
    ({"gradient_clipping": -1.0}, "gradient_clipping"),
    ({"gradient_clipping": "1.0"}, "gradient_clipping"),
    ({"communication_data_type": "int8"}, "communication_data_type"),
    ({"communication_data_type": 16}, "communication_data_type"),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, "fp16.loss_scale"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis"),
    ({"fp16": {"enabled": True, "consecutive_hysteresis": "no"}},
     "fp16.consecutive_hysteresis"),
    ({"zero_optimization": {"stage": 3,
                            "stage3_param_persistence_threshold": -1}},
     "zero_optimization.stage3_param_persistence_threshold"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "gpu"}}}, "zero_optimization.offload_optimizer.device"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "pin_memory": "true"}}},
     "zero_optimization.offload_optimizer.pin_memory"),
    ({"zero_optimization": {"stage": 2, "overlap_comm": "true"}},
     "zero_optimization.overlap_comm"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1.5}},
     "zero_optimization.reduce_bucket_size"),
])
def test_bad_types_error_naming_the_key(config, key):
  for mode in ("error", "warn"):
    with pytest.raises(ValueError, match=_key(key)):
      zj.from_deepspeed(config, unsupported=mode)


def test_offload_param_maps_to_stage3_parameter_offload():
  cfg = _load({"zero_optimization": {"stage": 3, "offload_param": {
      "device": "cpu", "pin_memory": True}}})
  assert cfg.offload_params == "host"
  with pytest.raises(ValueError, match="nvme|NVMe"):
    _load({"zero_optimization": {"stage": 3, "offload_param": {
        "device": "nvme"}}})
  with pytest.raises(ValueError, match="stage=3"):
    _load({"zero_optimization": {"stage": 2, "offload_param": {
        "device": "cpu"}}})


def test_the_mapping_table_is_the_translation():
  table = zconfig.mapping_table_markdown()
  lines = table.splitlines()
  assert lines[0].startswith("| DeepSpeed key | ZeroConfig field")
  assert len(lines) == 2 + len(ds_mapping.MAPPING)
  for row, line in zip(ds_mapping.MAPPING, lines[2:]):
    assert line.startswith(f"| `{row.key}` |")
  # The top-level count rows set their field from their key.
  for row in ds_mapping.MAPPING:
    if row.read is None or not row.key.startswith(("train_", "gradient_")):
      continue
    assert getattr(zj.from_deepspeed({row.key: 2}), row.field) == 2
  # The module docstring points to the table instead of repeating it.
  assert "mapping_table_markdown" in deepspeed.__doc__
  assert "stage3_param_persistence_threshold" not in deepspeed.__doc__.split(
      "Notes on the mapping")[0]


def _root():
  return os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))


def test_the_docs_table_is_the_mapping_table():
  docs = os.path.join(_root(), "docs", "deepspeed.md")
  with open(docs, encoding="utf-8") as f:
    text = f.read()
  assert zconfig.mapping_table_markdown().strip() in text, (
      "paste zero_jax.config.mapping_table_markdown() into " + docs)
  assert zconfig.key_list_markdown().strip() in text, (
      "paste zero_jax.config.key_list_markdown() into " + docs)


def test_the_key_list_covers_every_table():
  table = zconfig.key_list_markdown()
  for key in (list(deepspeed_keys.NO_EFFECT_KEYS) +
              list(deepspeed_keys.UNSUPPORTED_WHY) +
              list(deepspeed_keys.ALIASES) + list(deepspeed_keys.SWITCHED) +
              [row.key for row in ds_mapping.MAPPING]):
    assert f"| `{key}` |" in table, key
  # The logging keys say what zero_jax does instead, not "XLA".
  line = next(l for l in table.splitlines() if "`steps_per_print`" in l)
  assert "JsonlLogger" in line and "XLA" not in line


@pytest.mark.parametrize("config,message", [
    ({"train_micro_batch_size_per_gpu": "8"},
     "'train_micro_batch_size_per_gpu' must be an integer >= 1, got '8' "
     "(a str); write the number without quotes"),
    ({"zero_optimization": {"stage": 4}},
     "'zero_optimization.stage' must be one of (0, 1, 2, 3), got 4"),
    ({"gradient_clipping": float("inf")},
     "'gradient_clipping' must be a finite number >= 0, got inf"),
    ({"fp16": {"enabled": 1}}, "'fp16.enabled' must be true or false, got 1"),
    ({"communication_data_type": 16},
     "'communication_data_type' must be a string, got 16"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "ratio": 1.5}}},
     "'zero_optimization.offload_optimizer.ratio' must be a finite number "
     ">= 0 and <= 1, got 1.5"),
])
def test_bad_values_say_what_the_key_must_be(config, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    zj.from_deepspeed(config)


def test_sizes_take_integral_floats_as_json_writes_them():
  with pytest.warns(UserWarning, match="no effect"):
    zj.from_deepspeed({"zero_optimization": {"stage": 3,
                                             "reduce_bucket_size": 5e8}})
  cfg = _load({"zero_optimization": {
      "stage": 3, "stage3_param_persistence_threshold": 1e3}})
  assert cfg.min_shard_elements == 1001
  assert type(cfg.min_shard_elements) is int


# ------------------------------------------------ issue 26: as people write


def test_auto_without_effect_needs_no_value():
  # (Read as absent: no value, no warning.)
  cfg = _load({"zero_optimization": {
      "stage": 2, "reduce_bucket_size": "auto",
      "stage3_param_persistence_threshold": "auto"}})
  assert cfg.stage == 2 and cfg.min_shard_elements == 1024


def test_every_auto_left_is_reported_at_once_with_its_keyword():
  config = {"train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
            "zero_optimization": {
                "stage": 3, "stage3_param_persistence_threshold": "auto"}}
  with pytest.raises(ValueError) as info:
    zj.from_deepspeed(config)
  message = str(info.value)
  for key, word in [("train_micro_batch_size_per_gpu",
                     "per_device_train_batch_size"),
                    ("gradient_accumulation_steps",
                     "gradient_accumulation_steps"),
                    ("gradient_clipping", "max_grad_norm"),
                    ("bf16.enabled", "bf16"),
                    ("zero_optimization.stage3_param_persistence_threshold",
                     "hidden_size")]:
    assert re.search(_key(key) + f": pass {word}", message), (key, message)
  cfg = _load(config, per_device_train_batch_size=2,
              gradient_accumulation_steps=3, max_grad_norm=0.5, bf16=True,
              hidden_size=64)
  assert (cfg.micro_batch_size, cfg.grad_accum_steps,
          cfg.train_batch_size) == (2, 3, None)
  assert cfg.batch_sizes(8) == (48, 2, 3)
  assert cfg.clip_grad_norm == 0.5 and cfg.compute_dtype == "bfloat16"
  assert cfg.min_shard_elements == 641  # 10 x hidden_size, + 1


def test_two_batch_sizes_determine_an_auto_third():
  cfg = _load({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2,
               "gradient_accumulation_steps": "auto"})
  assert cfg.batch_sizes(8) == (64, 2, 4)


def test_keywords_must_agree_with_written_values_and_exist():
  with pytest.raises(ValueError, match=r"'gradient_clipping' is 1.0 but "
                     r"max_grad_norm=0.5"):
    zj.from_deepspeed({"gradient_clipping": 1.0}, max_grad_norm=0.5)
  with pytest.raises(TypeError, match="per_device_train_batch_size"):
    zj.from_deepspeed({}, batch_size=2)


def test_field_names_and_aliases_are_both_read():
  zero = {"stage": 3, "param_persistence_threshold": 99,
          "gather_16bit_weights_on_model_save": True,
          "prefetch_bucket_size": 10, "max_live_parameters": 10,
          "max_reuse_distance": 10, "model_persistence_threshold":
          9223372036854775807}
  with pytest.warns(UserWarning, match="export_params"):
    cfg = zj.from_deepspeed({"zero_optimization": zero})
  assert cfg.min_shard_elements == 100
  with pytest.raises(ValueError, match="field and its alias"):
    zj.from_deepspeed({"zero_optimization": {
        "stage": 3, "param_persistence_threshold": 1,
        "stage3_param_persistence_threshold": 1}})


@pytest.mark.parametrize("mode", ["error", "warn"])
def test_deprecated_cpu_offload_maps_to_offload(mode):
  with pytest.warns(UserWarning, match="deprecated"):
    cfg = zj.from_deepspeed({"zero_optimization": {
        "stage": 3, "cpu_offload": True, "cpu_offload_param": True}},
        unsupported=mode)
  assert cfg.offload_optimizer == "host" and cfg.offload_params == "host"
  # Parameter offload below stage 3 cannot happen: an error, never a drop.
  with pytest.raises(ValueError, match="cpu_offload_param"):
    zj.from_deepspeed({"zero_optimization": {
        "stage": 2, "cpu_offload_param": True}}, unsupported=mode)


def test_new_schema_keys_are_known():
  with pytest.warns(UserWarning) as record:
    cfg = zj.from_deepspeed({
        "bf16": {"enabled": True, "immediate_grad_update": True,
                 "check_grad_overflow": False},
        "zero_optimization": {"stage": 3, "offload_optimizer": {
            "device": "cpu", "super_offload": True}}})
  assert cfg.skip_nonfinite is False and cfg.offload_optimizer == "host"
  text = "\n".join(str(w.message) for w in record)
  assert "bf16.immediate_grad_update" in text and "super_offload" in text


def test_monitors_and_switches_are_accepted_when_disabled():
  cfg = _load({"tensorboard": {"enabled": False, "output_path": "x"},
               "wandb": {"enabled": False}, "csv_monitor": {},
               "comet": {"enabled": False}, "comms_logger": {
                   "enabled": False, "verbose": True},
               "amp": {"enabled": False, "opt_level": "O2"},
               "flops_profiler": {"enabled": False}})
  assert cfg.stage == 0
  for name in ("csv_monitor", "comms_logger"):
    with pytest.raises(ValueError, match=f"{name}.enabled to false"):
      zj.from_deepspeed({name: {"enabled": True}})


def test_activation_checkpointing_maps_to_remat():
  with pytest.warns(UserWarning, match="contiguous_memory_optimization"):
    cfg = zj.from_deepspeed({"activation_checkpointing": {
        "partition_activations": True,
        "contiguous_memory_optimization": True,
        "synchronize_checkpoint_boundary": False, "number_checkpoints": 4,
        "profile": False}})
  assert cfg.remat == "full" and cfg.partition_activations
  # cpu_checkpointing: the layer inputs scan_layers tags go to host memory
  # (Pa+cpu with partition_activations).
  cfg = zj.from_deepspeed({"activation_checkpointing": {
      "cpu_checkpointing": True, "partition_activations": True}})
  assert cfg.remat == "offload_to_host" and cfg.remat_names == (
      "layer_input",) and cfg.partition_activations
  cfg = zj.from_deepspeed({"activation_checkpointing": {
      "cpu_checkpointing": True}})
  assert cfg.remat_names == ("layer_input",) and not cfg.partition_activations
  cfg = _load({"activation_checkpointing": {"cpu_checkpointing": True}},
              remat_names=("mlp_hidden",))
  assert cfg.remat == "offload_to_host" and cfg.remat_names == (
      "mlp_hidden",)


def test_logging_keys_give_their_own_reason():
  with pytest.warns(UserWarning) as record:
    zj.from_deepspeed({"steps_per_print": 10, "wall_clock_breakdown": True})
  (message,) = [str(w.message) for w in record]
  assert "JsonlLogger" in message and "Throughput" in message
  assert "XLA" not in message


# ------------------------------------------ keys DeepSpeed does not apply


def _warnings(config):
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    cfg = zj.from_deepspeed(config)
  return cfg, "\n".join(str(w.message) for w in record)


def test_sparse_attention_is_accepted_with_the_reason():
  # DeepSpeed's engine never reads it; model code builds the modules.
  cfg, text = _warnings({"sparse_attention": {"mode": "fixed", "block": 16}})
  assert cfg == zj.ZeroConfig(stage=0)
  assert "sparse_attention" in text and "SparseSelfAttention" in text
  assert "a JAX model implements its own attention" in text


@pytest.mark.parametrize("key,instead", [
    ("monitor_config", "tensorboard, wandb, csv_monitor and comet"),
    ("comms_config", "comms_logger"), ("log", "steps_per_print")])
def test_keys_deepspeed_does_not_read_warn_naming_what_it_reads(key,
                                                                 instead):
  cfg, text = _warnings({key: {"verbose": False}})
  assert cfg == zj.ZeroConfig(stage=0)
  assert f"{key!r} is not read by DeepSpeed either" in text
  assert instead in text and "logs nothing" not in text


def test_an_enabled_section_deepspeed_does_not_read_logs_nothing():
  _, text = _warnings({"monitor_config": {"enabled": True, "csv_monitor": {
      "enabled": False}}})
  assert "\"enabled\": true logs nothing" in text


def test_other_unknown_top_level_keys_stay_errors():
  with pytest.raises(ValueError, match="monitor_cfg: not a DeepSpeed key"):
    zj.from_deepspeed({"monitor_cfg": {}})


# ------------------------------------------------------------- Apex AMP


@pytest.mark.parametrize("level", [None, "O1", "O2", "o2"])
def test_amp_o1_o2_read_as_float16_with_apex_dynamic_scaling(level):
  amp = {"enabled": True} if level is None else {"enabled": True,
                                                 "opt_level": level}
  cfg, text = _warnings({"amp": amp})
  assert cfg.compute_dtype == "float16" and cfg.dynamic_loss_scale
  # Apex's LossScaler: 2**16, doubled after 2000 clean steps, halved on
  # every overflow.
  assert (cfg.initial_scale_power, cfg.loss_scale_window,
          cfg.hysteresis) == (16, 2000, 1)
  assert "fp32 master weights, float16 compute" in text
  assert "dynamic loss scaling" in text


def test_amp_params_map_or_are_refused_by_name():
  cfg, _ = _warnings({"amp": {"enabled": True, "loss_scale": 128,
                              "keep_batchnorm_fp32": None, "verbosity": 0,
                              "num_losses": 1, "master_weights": True}})
  assert cfg.compute_dtype == "float16" and cfg.loss_scale == 128
  cfg, _ = _warnings({"amp": {"enabled": True, "loss_scale": "dynamic",
                              "min_loss_scale": 0.5}})
  assert cfg.dynamic_loss_scale and cfg.min_loss_scale == 0.5
  for key, value in (("num_losses", 2), ("master_weights", False),
                     ("max_loss_scale", 1024.0),
                     ("patch_torch_functions", True)):
    with pytest.raises(ValueError, match=re.escape(f"amp.{key}")):
      zj.from_deepspeed({"amp": {"enabled": True, key: value}})


def test_amp_o0_is_float32_and_disabled_amp_reads_nothing():
  cfg, text = _warnings({"amp": {"enabled": True, "opt_level": "O0"}})
  assert cfg.compute_dtype is None and "O0" in text and "float32" in text
  cfg, _ = _warnings({"amp": {"enabled": False, "opt_level": "O3",
                              "anything": 1}})
  assert cfg == zj.ZeroConfig(stage=0)


@pytest.mark.parametrize("other,named", [
    ({"fp16": {"enabled": True}}, "fp16.enabled"),
    ({"bf16": {"enabled": True}}, "bf16.enabled"),
    ({"zero_optimization": {"stage": 1}}, "zero_optimization.stage")])
def test_amp_with_fp16_bf16_or_zero_is_an_error_as_in_deepspeed(other,
                                                                 named):
  with pytest.raises(ValueError, match=re.escape(named)) as info:
    zj.from_deepspeed({"amp": {"enabled": True}, **other})
  assert "'amp.enabled'" in str(info.value)
  assert "set fp16.enabled to true" in str(info.value)
