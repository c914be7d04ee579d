"""Bad input to ZeroConfig and the memory estimator ends in a clear error.

Every message names the field (or flag), shows the bad value and says what
to write instead; no check may end in a TypeError from a comparison, or
accept a value that breaks training later (an infinite loss scale).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import zero_jax as zj
from zero_jax.analysis import (comm_in_psi, estimate_activations,
                               estimate_comm, estimate_memory, main,
                               paper_model_state_bytes)
from zero_jax.analysis._memory import optimizer_state_bytes, paper_estimate

_NAN, _INF = float("nan"), float("inf")

# Field -> values it must reject on its own (other fields at defaults, or
# the ones given in _CONTEXT so that only the field under test is wrong).
_BAD = {
    "stage": [4, -1, 3.0, "3", True, None],
    "min_shard_elements": ["5", -1, 5.0, True, None],
    "seed": [1.0, "0", None, 2 ** 64],
    "remat": ["dots", ["full"], None, 1],
    "remat_names": ["mlp_hidden", (1,), ("",), 5],
    "layer_classes": ["Block", ("",), (5,), 5],
    "device_memory_bytes": [0, -1, 1.5, "80GB", True],
    "compute_dtype": ["int8", "fp8", 5, 1.5],
    "reduce_dtype": ["int8", 16, []],
    "grad_accum_steps": [0, -2, 2.0, "2", True],
    "train_batch_size": [0, 32.0, "32", False],
    "micro_batch_size": [0, -8, 8.5, "8"],
    "clip_grad_norm": ["1.0", 0, -1.0, _INF, _NAN, True],
    "loss_scale": [_NAN, _INF, -1.0, "128", 1e39, True],
    "initial_scale_power": [128, 1000, 10 ** 400, -1, 16.0, "16", True],
    "loss_scale_window": [0, 1000.0, "1000", 2 ** 31],
    "hysteresis": [0, 2.0, "2", 2 ** 31],
    "min_loss_scale": [_NAN, _INF, 0, -1.0, "1", 2.0 ** 17],
    "consecutive_hysteresis": [1, 0, "yes", None],
    "offload_optimizer": ["cpu", "disk", True, ["host"]],
    "nvme_path": ["", " ", 5, b"/mnt"],
    "nvme": [5, "fast", {"buffer_count": 0}, {"bogus": 1},
             {"block_bytes": 5000}, {"resume": "yes"}],
    "offload_params": ["cpu", True, ["host"]],
    "update_on": ["gpu", None, True],
    "delay_update": [1, 0, "no", None],
    "partition_activations": [1, 0, "yes", None],
    "skip_nonfinite": [1, 0, "yes", None],
    "max_consecutive_skips": [0, -1, 10.0, "10", True, 2 ** 31],
    "quantized_weights": [1, 0, "yes", None],
    "quantized_gradients": [1, 0, "yes", None],
    "prefetch": [1, 0, "yes", None],
    "hpz_partition_size": [0, -8, 8.0, "8", True, None],
    "loss_scope": ["globl", "", None, True, 1],
    "accumulation": ["whole", "per_micro_batch", True, 1],
}
# Fields that only make sense next to others: without these the error would
# be about the combination, not about the value under test.
_NVME = {"offload_optimizer": "nvme", "update_on": "host"}
_CONTEXT = {
    "offload_params": {"stage": 3},
    "nvme_path": _NVME,
    "nvme": {**_NVME, "nvme_path": "/mnt/nvme"},
}


def _names(field: str) -> tuple[str, ...]:
  """The names an error about ``field`` (a top-level field or a
  shorthand) may give it: its full name, and the shorthand's."""
  where = zj.config.SHORTHAND.get(field)
  full = f"ZeroConfig.{'.'.join(where)}" if where else None
  return tuple(n for n in (full, f"ZeroConfig.{field}") if n)


def test_every_field_has_bad_values():
  # A new field must come with its own checks and cases here: every
  # top-level field that is not a section, and every section field (by
  # its shorthand).
  sections = {s.NAME for s in (zj.MixedPrecision, zj.LossScaling,
                               zj.Offload, zj.ZeroPP, zj.Activations,
                               zj.Batch)}
  top = {f.name for f in dataclasses.fields(zj.ZeroConfig)}
  assert sections <= top
  assert set(_BAD) == (top - sections) | set(zj.config.SHORTHAND)
  assert {(s, f) for s, f in zj.config.SHORTHAND.values()} == {
      (s.NAME, f.name) for s in (zj.MixedPrecision, zj.LossScaling,
                                 zj.Offload, zj.ZeroPP, zj.Activations,
                                 zj.Batch) for f in dataclasses.fields(s)}


@pytest.mark.parametrize("field,value", [
    (field, value) for field, values in _BAD.items() for value in values],
    ids=lambda x: repr(x)[:20])
def test_bad_value_names_field_value_and_fix(field, value):
  with pytest.raises(ValueError) as info:
    zj.ZeroConfig(**_CONTEXT.get(field, {}), **{field: value})
  message = str(info.value)
  assert any(n in message for n in _names(field)), message
  # The value (cut short when huge), then what to write instead.
  assert repr(value)[:40] in message, message
  assert "; " in message and len(message.split("; ")[-1]) > 10, message


@pytest.mark.parametrize("kw", [
    dict(min_shard_elements="5"), dict(clip_grad_norm="1.0"),
    dict(min_shard_elements=[1]), dict(hysteresis="2"),
    dict(loss_scale_window=None), dict(min_loss_scale="1")])
def test_wrong_types_are_not_comparison_errors(kw):
  # These used to reach `value < 0` and raise "'<' not supported".
  with pytest.raises(ValueError) as info:
    zj.ZeroConfig(**kw)
  assert any(n in str(info.value) for n in _names(next(iter(kw))))


def test_number_written_as_a_string_or_float_says_so():
  with pytest.raises(ValueError, match="without quotes"):
    zj.ZeroConfig(min_shard_elements="5")
  with pytest.raises(ValueError, match="write 2, an int"):
    zj.ZeroConfig(grad_accum_steps=2.0)
  with pytest.raises(ValueError, match="True/False is not a number"):
    zj.ZeroConfig(stage=True)


def test_good_values_are_normalized():
  cfg = zj.ZeroConfig(stage=np.int64(2), min_shard_elements=np.int32(0),
                      clip_grad_norm=1, delay_update=np.bool_(False),
                      remat_names=["a"], remat="save_only_named",
                      compute_dtype="float16", loss_scale=np.float32(128),
                      initial_scale_power=127,
                      min_loss_scale=2.0 ** 127, max_consecutive_skips=1)
  assert (type(cfg.stage), type(cfg.min_shard_elements),
          type(cfg.clip_grad_norm), type(cfg.delay_update),
          type(cfg.loss_scale)) == (int, int, float, bool, float)
  assert cfg.remat_names == ("a",)
  assert cfg == dataclasses.replace(cfg)


def test_initial_scale_power_overflow_gives_the_largest_power():
  # 2**128 is inf in float32: the scale would overflow every step and every
  # step would be skipped, forever.
  with np.errstate(over="ignore"):
    assert np.isinf(np.float32(2.0 ** 128))
  assert np.isfinite(np.float32(2.0 ** 127))
  assert zj.ZeroConfig(compute_dtype="float16",
                       initial_scale_power=127).initial_scale_power == 127
  with pytest.raises(ValueError,
                     match=r"initial_scale_power.*got 128.*largest allowed "
                     r"power is 127"):
    zj.ZeroConfig(compute_dtype="float16", initial_scale_power=128)


def test_initial_scale_power_overflow_through_deepspeed():
  config = {"fp16": {"enabled": True, "initial_scale_power": 128}}
  for load in (zj.from_deepspeed, zj.config.from_deepspeed):
    with pytest.raises(ValueError) as info:
      load(config)
    message = str(info.value)
    assert "fp16.initial_scale_power" in message
    assert "largest allowed power is 127" in message


def test_deepspeed_infinite_clipping_names_its_key():
  with pytest.raises(ValueError, match="'gradient_clipping'"):
    zj.from_deepspeed({"gradient_clipping": _INF})


def test_new_fields():
  cfg = zj.ZeroConfig()
  assert cfg.skip_nonfinite is True and cfg.max_consecutive_skips == 10
  cfg = zj.ZeroConfig(skip_nonfinite=False, max_consecutive_skips=1)
  assert (cfg.skip_nonfinite, cfg.max_consecutive_skips) == (False, 1)
  with pytest.raises(ValueError, match="max_consecutive_skips.*>= 1|"
                     r"max_consecutive_skips.*\[1, "):
    zj.ZeroConfig(max_consecutive_skips=0)
  doc = zj.ZeroConfig.__doc__
  assert "skip_nonfinite:" in doc and "max_consecutive_skips:" in doc


def test_quantized_collectives_name_the_stages_they_need():
  assert not zj.ZeroConfig().quantized_weights
  assert not zj.ZeroConfig().quantized_gradients
  for stage in (0, 1, 2):
    with pytest.raises(ValueError, match="quantized_weights needs stage=3"):
      zj.ZeroConfig(stage=stage, quantized_weights=True)
  # (qgZ quantizes each device's own gradient: the default global loss's
  # sums are the compiler's, so it is refused there, naming the fix.)
  with pytest.raises(ValueError, match=r"qgZ.*loss_scope='per_device'"):
    zj.ZeroConfig(stage=1, quantized_gradients=True)
  with pytest.raises(ValueError, match="quantized_gradients needs stage >= 1"):
    zj.ZeroConfig(stage=0, quantized_gradients=True, loss_scope="per_device")
  cfg = zj.ZeroConfig(stage=1, quantized_gradients=np.bool_(True),
                      loss_scope="per_device")
  assert cfg.quantized_gradients is True
  assert zj.ZeroConfig(quantized_weights=True).quantized_weights


def test_existing_messages_still_match():
  with pytest.raises(ValueError, match="stage must be one of"):
    zj.ZeroConfig(stage=4)
  with pytest.raises(ValueError, match="stage=3"):
    zj.ZeroConfig(stage=2, offload_params="host")
  with pytest.raises(ValueError, match="NVMe"):
    zj.ZeroConfig(offload_optimizer="nvme")
  with pytest.raises(ValueError, match="set update_on='host'"):
    zj.ZeroConfig(offload_optimizer="nvme", nvme_path="/mnt/nvme")
  with pytest.raises(ValueError, match="nvme_path='/x' is read only with"):
    zj.ZeroConfig(nvme_path="/x")
  with pytest.raises(ValueError, match="parameters on NVMe are not"):
    zj.ZeroConfig(stage=3, offload_params="nvme")
  with pytest.raises(ValueError, match=r"write \('x',\)"):
    zj.ZeroConfig(remat="save_only_named", remat_names="x")


# ------------------------------------------------------------ estimator CLI


@pytest.mark.parametrize("argv,message", [
    (["--stage", "2", "--offload-params"],
     "--offload-params needs --stage 3"),
    (["--stage", "0", "--offload-params"], "--offload-optimizer"),
    (["--params", "1e400"], "beyond a float's range"),
    (["--params", "0"], "count must be > 0"),
    (["--params", "-5"], "invalid count '-5'"),
    (["--params", "1e308"], "overflows"),
    (["--k", "nan"], "argument --k: must be a finite number >= 0"),
    (["--k", "inf"], "argument --k: must be a finite number >= 0"),
    (["--k", "-1"], "argument --k: must be a finite number >= 0"),
    (["--k", "1e308"], "--k 1e+308"),
    (["--devices", "0"], "argument --devices: must be >= 1"),
    (["--replica", "0"], "argument --replica: must be >= 1"),
    (["--layers", "0", "--hidden", "8", "--seq-len", "4", "--micro-batch",
      "1", "--heads", "2"], "argument --layers: must be >= 1"),
    (["--vocab", "-1", "--layers", "2", "--hidden", "8", "--seq-len", "4",
      "--micro-batch", "1", "--heads", "2"], "argument --vocab"),
])
def test_cli_rejects_bad_input_naming_the_flag(capsys, argv, message):
  defaults = {"--params": "1e9", "--devices": "8"}
  base = [x for flag, value in defaults.items() if flag not in argv
          for x in (flag, value)]
  with pytest.raises(SystemExit) as e:
    main([*base, *argv])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "usage:" in err and message in err, err


def test_cli_offload_params_with_all_stages_applies_to_stage_3(capsys):
  assert main(["--params", "1e9", "--devices", "8", "--stage", "all",
               "--offload-params"]) == 0
  out = capsys.readouterr().out
  stage3 = out[out.index("stage 3:"):]
  assert "host (offloaded)" in stage3
  assert "host (offloaded)" not in out[:out.index("stage 3:")]


def test_cli_named_remat_with_compile_needs_names(capsys):
  # Rejected before anything is compiled (or the compile extra is looked
  # for): ZeroConfig would refuse a named policy without names.
  with pytest.raises(SystemExit) as e:
    main(["--compile", "h100", "--devices", "1", "--remat",
          "save_only_named", "--layers", "2", "--hidden", "64", "--heads",
          "4", "--vocab", "64", "--seq-len", "16", "--micro-batch", "2"])
  assert e.value.code == 2
  assert "--remat save_only_named needs checkpoint names" in (
      capsys.readouterr().err)


# ------------------------------------------------------------ memory API


@pytest.mark.parametrize("call,message", [
    (lambda: estimate_memory(-5, 8, 3), "psi must be a finite number > 0"),
    (lambda: estimate_memory(0, 8, 3), "psi must be a finite number > 0"),
    (lambda: estimate_memory(_NAN, 8, 3), "got nan"),
    (lambda: estimate_memory(_INF, 8, 3), "got inf"),
    (lambda: estimate_memory("1e9", 8, 3), "got '1e9'"),
    (lambda: estimate_memory(1e308, 8, 0), "overflows a float64"),
    (lambda: estimate_memory(1e9, 0, 3), "devices must be an integer >= 1"),
    (lambda: estimate_memory(1e9, 8.0, 3), "write 8, an int"),
    (lambda: estimate_memory(1e9, 8, 3, replica=0), "replica must be"),
    (lambda: estimate_memory(1e9, 8, 3.0), "stage must be 0, 1, 2 or 3, "
     "got 3.0; pass the ZeRO stage as an int"),
    (lambda: estimate_memory(1e9, 8, 3, k=-1), "k must be a finite number"),
    (lambda: estimate_memory(1e9, 8, 3, k=_NAN), "k must be a finite number"),
    (lambda: estimate_memory(1e9, 8, 3, activations=-1.0), "activations"),
    (lambda: estimate_memory(1e9, 8, 3, activations=_INF), "activations"),
    (lambda: estimate_memory(1e9, 8, 3, replicated=-1), "replicated"),
    (lambda: estimate_memory(1e9, 8, 3, replicated=2e9), "exceeds"),
    (lambda: estimate_memory(1e9, 8, 2, offload_params=True),
     "offload_params needs stage 3"),
    (lambda: estimate_memory(1e9, 8, 3, offload_optimizer="yes"),
     "offload_optimizer must be True or False"),
    (lambda: estimate_memory(1e9, 8, 3, update_on="gpu"),
     "ZeroConfig.offload.update"),
    (lambda: estimate_comm(-1, 8, 3), "psi must be"),
    (lambda: estimate_comm(1e9, 8, 3, replica=3), "not divisible"),
    (lambda: estimate_comm(1e9, 8, 3, replicated=_NAN), "replicated"),
    (lambda: paper_estimate(1e9, 0, 3), "n must be an integer >= 1"),
    (lambda: paper_estimate(1e9, 8, 3, k=-12), "k must be"),
    (lambda: paper_model_state_bytes(_INF, 8, 3), "psi must be"),
    (lambda: paper_model_state_bytes(1e9, 8, True), "stage must be"),
    (lambda: paper_model_state_bytes(1e9, 8, 3, param_bytes=-2),
     "param_bytes"),
    (lambda: comm_in_psi({}, 0, 8), "psi must be"),
    (lambda: comm_in_psi({}, 1e9, 0), "n must be"),
    (lambda: optimizer_state_bytes(k=_INF), "k must be"),
    (lambda: estimate_activations(layers=0, hidden=8, seq_len=4,
                                  micro_batch=1, heads=2), "layers"),
    (lambda: estimate_activations(layers=2, hidden=8, seq_len=4.5,
                                  micro_batch=1, heads=2), "seq_len"),
    (lambda: estimate_activations(layers=2, hidden=8, seq_len=4,
                                  micro_batch=1, heads=2, vocab=-1), "vocab"),
    (lambda: estimate_activations(layers=2, hidden=8, seq_len=4,
                                  micro_batch=1, heads=2,
                                  bytes_per_element=_NAN),
     "bytes_per_element"),
])
def test_memory_functions_reject_bad_sizes(call, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    call()


def test_memory_functions_still_take_good_sizes():
  assert estimate_memory(1000, 8, 3, replicated=1000).params == 4000
  assert estimate_memory(np.int64(1000), np.int64(8), 3).params == 500
  assert math.isfinite(estimate_memory(1e300, 8, 3).total)
  assert optimizer_state_bytes(k=0) == 0
  assert estimate_activations(layers=1, hidden=8, seq_len=4, micro_batch=1,
                              heads=2, vocab=0) > 0


# ------------------------------------------------------------ one format


@pytest.mark.parametrize("call,name,what,value", [
    (lambda: zj.ZeroConfig(hysteresis="2"),
     "ZeroConfig.loss_scaling.hysteresis",
     "an integer in [1, ", "'2' (a str)"),
    (lambda: estimate_memory(1e9, "8", 3), "devices",
     "an integer >= 1", "'8' (a str)"),
    (lambda: zj.from_deepspeed({"fp16": {"enabled": True,
                                         "hysteresis": "2"}}),
     "DeepSpeed config key 'fp16.hysteresis'", "an integer >= 1",
     "'2' (a str)"),
], ids=["ZeroConfig", "estimator", "DeepSpeed"])
def test_config_estimators_and_deepspeed_share_one_message(call, name, what,
                                                           value):
  # One set of checks: the same mistake reads the same wherever it is made,
  # with the same hint after the value.
  with pytest.raises(ValueError) as info:
    call()
  message = str(info.value)
  assert message.startswith(f"{name} must be {what}"), message
  assert f", got {value}; write the number without quotes" in message, (
      message)


def test_a_bool_is_not_a_number_anywhere():
  for call in (lambda: zj.ZeroConfig(seed=True),
               lambda: estimate_memory(1e9, True, 3),
               lambda: zj.from_deepspeed({"train_batch_size": True})):
    with pytest.raises(ValueError, match="got True; True/False is not a "
                       "number here"):
      call()


def test_choices_of_ints_take_numpy_ints_but_not_bools():
  assert type(zj.ZeroConfig(stage=np.int32(1)).stage) is int
  assert estimate_memory(1e9, 8, np.int64(3)) == estimate_memory(1e9, 8, 3)
  assert zj.from_deepspeed({"zero_optimization": {"stage": 1}}).stage == 1
  with pytest.raises(ValueError, match=r"'zero_optimization\.stage' must be "
                     r"one of \(0, 1, 2, 3\), got True"):
    zj.from_deepspeed({"zero_optimization": {"stage": True}})
