"""The decision pass: every choice of a config on a mesh made once, each
with its reason, and what the engine describes."""

from __future__ import annotations

import optax
import pytest

import zero_jax as zj
from zero_jax import layout as zl
from tests import _models as m

# Every decision describe() states, by name.
_NAMES = ("batch", "loss", "accumulation", "remat", "prefetch", "hpZ",
          "loss scaling", "non-finite steps", "clipping")


def test_every_decision_has_a_reason():
  d = zl.decide(zj.ZeroConfig(stage=3, compute_dtype="float16",
                              clip_grad_norm=1.0, grad_accum_steps=2,
                              loss_scale_window=7), zj.make_mesh())
  assert tuple(name for name, _ in d.reasons) == _NAMES
  lines = d.describe()
  assert len(lines) == len(_NAMES) and all(lines)
  said = dict(d.reasons)
  assert "doubled after 7 clean steps" in said["loss scaling"]
  assert "to global norm 1" in said["clipping"]
  assert "whole_batch over 2 micro-batches (the loss scope's" in (
      said["accumulation"])
  assert d.batch.accum_steps == 2 and d.batch.num_devices == 8
  assert d.placement == zl.decide_placement(zj.ZeroConfig(
      stage=3, compute_dtype="float16", grad_accum_steps=2), 2)


def test_accumulation_is_resolved_by_the_loss_scope():
  glob = zl.decide(zj.ZeroConfig(), zj.make_mesh())
  per = zl.decide(zj.ZeroConfig(loss_scope="per_device"), zj.make_mesh())
  assert glob.accumulation is zj.Accumulation.WHOLE_BATCH
  assert per.accumulation is zj.Accumulation.MEAN_OF_MICRO_BATCHES
  assert glob.global_loss and not per.global_loss


def test_prefetch_is_decided_again_for_the_remat_auto_chose():
  d = zl.decide(zj.ZeroConfig(stage=3, remat="auto"), zj.make_mesh())
  assert d.prefetch is zl.Prefetch.OFF  # (auto: not yet "full")
  full = d.with_remat(zj.RematPolicy.FULL)
  assert full.prefetch is zl.Prefetch.AUTO and d.prefetch is zl.Prefetch.OFF
  assert dict(full.reasons)["prefetch"].startswith(
      "prefetch (auto): each layer")
  assert dict(full.reasons)["remat"].startswith("remat (full)")
  # One device: nothing to gather ahead.
  one = zl.decide(zj.ZeroConfig(stage=3), zj.make_mesh(num_devices=1))
  assert one.prefetch is zl.Prefetch.OFF


def test_the_mesh_is_checked_once_with_the_fix():
  with pytest.raises(ValueError, match=r"make_mesh\(replica=2\)"):
    zl.decide(zj.ZeroConfig(hpz_partition_size=4), zj.make_mesh())
  d = zl.decide(zj.ZeroConfig(hpz_partition_size=4),
                zj.make_mesh(replica=2))
  assert d.hierarchical and "groups of 4 devices" in dict(d.reasons)["hpZ"]
  with pytest.raises(ValueError, match="not divisible|contradict|divide"):
    zl.decide(zj.ZeroConfig(train_batch_size=12, micro_batch_size=1),
              zj.make_mesh())


def test_describe_states_every_decision():
  loss_fn, params, _ = m.MODELS["gpt"](steps=1)
  engine = zj.Engine(loss_fn, optax.sgd(0.1),
                     zj.ZeroConfig(stage=3, compute_dtype="bfloat16"),
                     zj.make_mesh())
  engine.init(params)
  text = engine.describe()
  for name in _NAMES:
    assert any(line.startswith(name) for line in text.splitlines()), name
