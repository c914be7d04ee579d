"""zj.initialize: deepspeed.initialize for zero_jax."""

import json
import pathlib

import numpy as np
import optax
import pytest

import zero_jax as zj
from tests import _models as m

_CONFIG = {"train_micro_batch_size_per_gpu": "auto",
           "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
           "optimizer": {"type": "AdamW", "params": {
               "lr": "auto", "betas": "auto", "eps": "auto",
               "weight_decay": "auto"}},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}
_HF = dict(per_device_train_batch_size=4, gradient_accumulation_steps=1,
           max_grad_norm=1.0, bf16=False, learning_rate=1e-2,
           adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
           weight_decay=0.0)


def test_initialize_builds_engine_and_state_from_the_config():
  mesh = zj.make_mesh(num_devices=8)
  engine, state = zj.initialize(m.mlp_loss, m.mlp_params(), _CONFIG, mesh,
                                **_HF)
  assert engine.config.stage == 3 and engine.train_batch_size == 32
  batches = m.mlp_batches(3)
  losses = []
  for b in batches:
    state, metrics = engine.step(state, b)
    losses.append(float(metrics["loss"]))
  # The same as Engine with optax's AdamW (DeepSpeed's AdamW is optax's).
  ref = zj.Engine(m.mlp_loss, optax.adamw(1e-2, weight_decay=0.0),
                  engine.config, mesh)
  ref_losses, _, _ = m.train_engine(ref, m.mlp_params(), batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)


def test_mesh_defaults_to_every_device():
  engine, _ = zj.initialize(m.mlp_loss, m.mlp_params(),
                            zj.ZeroConfig(stage=1), tx=optax.sgd(0.1))
  assert engine.mesh.size == len(__import__("jax").devices())


def test_a_deepspeed_config_takes_its_loss_scope_as_a_keyword():
  # DeepSpeed's JSON has no key for it: qgZ needs the per-device loss.
  qgz = {"zero_optimization": {"stage": 2, "zero_quantized_gradients": True}}
  engine, _ = zj.initialize(m.mlp_loss, m.mlp_params(), qgz,
                            tx=optax.sgd(0.1), loss_scope="per_device")
  assert engine.config.loss_scope == "per_device"
  assert engine.config.quantized_gradients
  with pytest.raises(ValueError, match="loss_scope= keyword"):
    zj.initialize(m.mlp_loss, m.mlp_params(), qgz, tx=optax.sgd(0.1))
  with pytest.raises(TypeError, match="ZeroConfig has its own"):
    zj.initialize(m.mlp_loss, m.mlp_params(), zj.ZeroConfig(stage=1),
                  tx=optax.sgd(0.1), loss_scope="per_device")


def test_optimizer_from_config_and_tx_is_an_error():
  with pytest.raises(ValueError, match="do not provide an optimizer"):
    zj.initialize(m.mlp_loss, m.mlp_params(), _CONFIG, tx=optax.sgd(0.1),
                  **_HF)
  with pytest.raises(ValueError, match="no optimizer.*pass tx="):
    zj.initialize(m.mlp_loss, m.mlp_params(), {"zero_optimization": {
        "stage": 1}})
  with pytest.raises(ValueError, match="schedule_from_deepspeed"):
    zj.initialize(m.mlp_loss, m.mlp_params(), {"scheduler": {
        "type": "WarmupLR", "params": {"warmup_num_steps": 2}}},
                  tx=optax.sgd(0.1))


def test_unfilled_autos_are_listed_in_one_error_and_keywords_checked():
  with pytest.raises(ValueError) as info:
    zj.initialize(m.mlp_loss, m.mlp_params(), _CONFIG)
  message = str(info.value)
  for key in ("'optimizer.params.lr': pass learning_rate",
              "'optimizer.params.betas': pass adam_beta1=... and "
              "adam_beta2=...,",
              "'gradient_clipping': pass max_grad_norm",
              "'bf16.enabled': pass bf16"):
    assert key in message, message
  assert "reduce_bucket_size" not in message  # (no effect: no value needed)
  with pytest.raises(TypeError, match="learning_rate"):
    zj.initialize(m.mlp_loss, m.mlp_params(), _CONFIG, lr=1e-3)
  with pytest.raises(TypeError, match="ZeroConfig"):
    zj.initialize(m.mlp_loss, m.mlp_params(), zj.ZeroConfig(),
                  tx=optax.sgd(0.1), learning_rate=1e-3)


# A config scheduler for a client optimizer (DeepSpeed's own test config:
# WarmupLR, train_batch_size 4, fp16).
_FUNC_SCHEDULER = (pathlib.Path(__file__).resolve().parent.parent / "data" /
                   "deepspeed" / "deepspeed__ds_config_func_scheduler.json")


def _sgd(lr):
  # (inject_hyperparams: the engine reports the rate of each update.)
  return optax.inject_hyperparams(optax.sgd)(learning_rate=lr)


def test_a_config_scheduler_drives_a_tx_factory():
  # (train_batch_size 4: 4 devices, as DeepSpeed needs for it too.)
  mesh = zj.make_mesh(num_devices=4)
  seen = []

  def factory(lr):
    seen.append(lr)
    return _sgd(lr)

  engine, state = zj.initialize(m.mlp_loss, m.mlp_params(), _FUNC_SCHEDULER,
                                mesh, factory)
  assert len(seen) == 1 and callable(seen[0])
  schedule = zj.config.schedule_from_deepspeed(
      json.loads(_FUNC_SCHEDULER.read_text())["scheduler"], 0.0)
  rates = []
  for b in m.mlp_batches(4, batch=4):
    state, metrics = engine.step(state, b)
    rates.append(float(metrics["learning_rate"]))
  np.testing.assert_allclose(rates, [float(schedule(k)) for k in range(4)],
                             rtol=1e-6)
  # (Log warmup to warmup_max_lr: 0 for the first two updates, as in
  # DeepSpeed, then rising.)
  assert rates[:2] == [0.0, 0.0] and 1e-3 > rates[3] > rates[2] > 0


def test_a_plain_tx_with_a_config_scheduler_names_the_factory_form():
  with pytest.raises(ValueError, match="factory of the learning rate"):
    zj.initialize(m.mlp_loss, m.mlp_params(), _FUNC_SCHEDULER,
                  zj.make_mesh(num_devices=4), optax.sgd(0.1))


def test_a_factory_takes_the_base_lr_from_learning_rate():
  config = {"scheduler": {"type": "WarmupLR", "params": {
      "warmup_num_steps": 2, "warmup_type": "linear"}}}
  with pytest.raises(ValueError, match="pass learning_rate="):
    zj.initialize(m.mlp_loss, m.mlp_params(), config, tx=optax.sgd)
  engine, state = zj.initialize(m.mlp_loss, m.mlp_params(), config,
                                tx=_sgd, learning_rate=0.5)
  rates = []
  for b in m.mlp_batches(3):
    state, metrics = engine.step(state, b)
    rates.append(float(metrics["learning_rate"]))
  # Linear warmup to the base lr 0.5 over 2 steps: update k uses
  # DeepSpeed's get_lr() at iteration k - 1 (warmup_min_lr at -1).
  np.testing.assert_allclose(rates, [0.0, 0.0, 0.25], rtol=1e-6)


def test_a_factory_without_a_scheduler_gets_learning_rate_or_errors():
  config = {"zero_optimization": {"stage": 2}}
  with pytest.raises(ValueError, match="pass learning_rate="):
    zj.initialize(m.mlp_loss, m.mlp_params(), config, tx=optax.sgd)
  engine, state = zj.initialize(m.mlp_loss, m.mlp_params(), config,
                                tx=optax.sgd, learning_rate=0.1)
  ref = zj.Engine(m.mlp_loss, optax.sgd(0.1), engine.config, engine.mesh)
  batches = m.mlp_batches(2)
  losses = []
  for b in batches:
    state, metrics = engine.step(state, b)
    losses.append(float(metrics["loss"]))
  ref_losses, _, _ = m.train_engine(ref, m.mlp_params(), batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  with pytest.raises(TypeError, match="GradientTransformation"):
    zj.initialize(m.mlp_loss, m.mlp_params(), config, tx=lambda lr: lr,
                  learning_rate=0.1)


def test_a_factory_refuses_onecycles_momentum_cycle():
  # DeepSpeed's OneCycle sets beta1 too; a factory of the learning rate
  # cannot take it, so the cycle is an error, not silently dropped.
  onecycle = {"type": "OneCycle", "params": {
      "cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2,
      "cycle_first_step_size": 4}}
  with pytest.raises(ValueError, match="cycle_momentum"):
    zj.initialize(m.mlp_loss, m.mlp_params(), {"scheduler": onecycle},
                  tx=optax.adam)
  off = dict(onecycle, params=dict(onecycle["params"], cycle_momentum=False))
  engine, _ = zj.initialize(m.mlp_loss, m.mlp_params(), {"scheduler": off},
                            tx=optax.adam)
  assert engine.config.stage == 0
