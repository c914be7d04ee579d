"""The nested ZeroConfig: sections, the flat shorthand, and one home for
each rule between fields."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

import zero_jax as zj
from zero_jax import config as zc

_FLAT = dict(stage=2, compute_dtype="bfloat16", offload_optimizer="host",
             loss_scale_window=500, quantized_gradients=True,
             loss_scope="per_device", remat="dots_saveable",
             grad_accum_steps=2, accumulation="mean_of_micro_batches")
_NESTED = dict(
    stage=2, loss_scope=zj.LossScope.PER_DEVICE,
    precision=zj.MixedPrecision(compute="bfloat16"),
    offload=zj.Offload(optimizer=zj.Tier.HOST),
    loss_scaling=zj.LossScaling(window=500),
    zeropp=zj.ZeroPP(quantized_gradients=True),
    activations=zj.Activations(remat=zj.RematPolicy.DOTS_SAVEABLE),
    batch=zj.Batch(accum_steps=2,
                   accumulation=zj.Accumulation.MEAN_OF_MICRO_BATCHES))


def test_the_shorthand_builds_the_nested_config():
  flat, nested = zj.ZeroConfig(**_FLAT), zj.ZeroConfig(**_NESTED)
  assert flat == nested and hash(flat) == hash(nested)
  # Sections as mappings (a config read from YAML or JSON) too.
  as_maps = {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v)
             for k, v in _NESTED.items()}
  assert zj.ZeroConfig(**as_maps) == nested
  assert zj.ZeroConfig.from_dict(as_maps) == nested
  assert zj.ZeroConfig(**zc.nest(_FLAT)) == nested
  # Reading the shorthand reads the section.
  assert flat.offload_optimizer is flat.offload.optimizer is zj.Tier.HOST
  assert flat.grad_accum_steps == flat.batch.accum_steps == 2
  assert pickle.loads(pickle.dumps(flat)) == flat


def test_choices_are_enums_equal_to_their_strings():
  cfg = zj.ZeroConfig(offload_optimizer="host", update_on="host")
  assert cfg.offload.update is zj.UpdateOn.HOST and cfg.update_on == "host"
  assert cfg.loss_scope is zj.LossScope.GLOBAL and cfg.loss_scope == "global"
  # Printed as the strings people write.
  assert repr(cfg.offload.optimizer) == "'host'"
  assert f"{cfg.loss_scope}" == "global"


@pytest.mark.parametrize("written,canonical", [
    ("bf16", "bfloat16"), ("fp16", "float16"), ("half", "float16"),
    ("fp32", "float32"), ("bfloat16", "bfloat16")])
def test_short_dtype_names_are_read(written, canonical):
  assert zj.ZeroConfig(compute_dtype=written).compute_dtype == canonical
  assert zj.MixedPrecision(reduce=written).reduce == canonical


def test_a_shorthand_keyword_overrides_its_sections_field():
  cfg = zj.ZeroConfig(offload=zj.Offload(optimizer="host"),
                      update_on="host", delay_update=True)
  assert cfg.offload == zj.Offload(optimizer="host", update="host",
                                   delay=True)
  # (So dataclasses.replace takes the shorthand.)
  again = dataclasses.replace(cfg, delay_update=False, stage=1)
  assert (again.stage, again.offload.delay, again.offload.optimizer) == (
      1, False, "host")


def test_unknown_keys_and_wrong_sections_name_the_fix():
  with pytest.raises(ValueError, match=r"unknown ZeroConfig key\(s\) "
                     r"\['offload_optimiser'\].*shorthand"):
    zj.ZeroConfig(offload_optimiser="host")
  with pytest.raises(ValueError, match=r"unknown ZeroConfig.offload "
                     r"field\(s\) \['tier'\]; valid fields are"):
    zj.ZeroConfig(offload={"tier": "host"})
  with pytest.raises(ValueError, match=r"ZeroConfig.offload must be an "
                     r"instance of Offload or a mapping of its fields, "
                     r"got 'host'"):
    zj.ZeroConfig(offload="host")


def test_errors_name_the_field_in_full_and_its_shorthand():
  with pytest.raises(ValueError, match=r"^ZeroConfig.offload.update "
                     r"\(update_on\) must be one of"):
    zj.Offload(update="gpu")
  with pytest.raises(ValueError, match=r"^ZeroConfig.batch.accum_steps "
                     r"\(grad_accum_steps\) must be"):
    zj.ZeroConfig(grad_accum_steps=0)


def test_rules_inside_a_section_are_the_sections_own():
  # Raised by the section alone, with no ZeroConfig around it.
  with pytest.raises(ValueError, match="set nvme_path"):
    zj.Offload(optimizer="nvme", update="host")
  with pytest.raises(ValueError, match="delay_update overlaps"):
    zj.Offload(optimizer="host", delay=True)
  with pytest.raises(ValueError, match="update_on='host' runs the update"):
    zj.Offload(update="host")
  with pytest.raises(ValueError, match="min_loss_scale"):
    zj.LossScaling(initial_power=2, min_scale=8.0)
  with pytest.raises(ValueError, match="needs remat_names"):
    zj.Activations(remat="save_only_named")
  # Rules across sections are ZeroConfig's.
  zj.Offload(params="host")
  with pytest.raises(ValueError, match="offload_params needs stage=3"):
    zj.ZeroConfig(stage=2, offload=zj.Offload(params="host"))


def test_deepspeed_builds_the_nested_form():
  cfg = zj.from_deepspeed({
      "bf16": {"enabled": True}, "gradient_accumulation_steps": 4,
      "zero_optimization": {"stage": 3, "offload_optimizer": {
          "device": "cpu"}}})
  assert cfg.precision == zj.MixedPrecision(compute="bfloat16")
  assert cfg.offload.optimizer is zj.Tier.HOST
  assert cfg.batch.accum_steps == 4
  table = zc.mapping_table_markdown()
  assert "`offload.optimizer` (`offload_optimizer`)" in table
