"""Real DeepSpeed configs, unchanged, train one step through zj.initialize.

Each ``tests/data/deepspeed/*.json`` (sources in ``SOURCES.md`` beside them)
is loaded as written, with the values HuggingFace's Trainer would fill its
``"auto"`` from, onto 8 simulated CPU devices; a tiny MLP (dims divisible by
8) trains (three steps) on the batch the engine asks for. A config that cannot
train must fail naming its key and the fix, as listed in ``_EXPECTED``;
at least 90% train.
"""

import json
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj

_DATA = pathlib.Path(__file__).resolve().parent.parent / "data" / "deepspeed"
_FILES = sorted(_DATA.glob("*.json"))

# What HuggingFace's Trainer would pass, and the keys each fills when the
# config says "auto" there (a keyword is passed only for those: a value
# the config writes must agree with it, as in the Trainer).
_TRAINER = {
    "per_device_train_batch_size": (2, ["train_micro_batch_size_per_gpu",
                                        "train_batch_size"]),
    "gradient_accumulation_steps": (1, ["gradient_accumulation_steps",
                                        "train_batch_size"]),
    "max_grad_norm": (1.0, ["gradient_clipping"]),
    "learning_rate": (1e-3, ["optimizer.params.lr",
                             "scheduler.params.warmup_max_lr"]),
    "adam_beta1": (0.9, ["optimizer.params.betas"]),
    "adam_beta2": (0.999, ["optimizer.params.betas"]),
    "adam_epsilon": (1e-8, ["optimizer.params.eps"]),
    "weight_decay": (0.0, ["optimizer.params.weight_decay"]),
    "warmup_steps": (2, ["scheduler.params.warmup_num_steps"]),
    "max_steps": (10, ["scheduler.params.total_num_steps"]),
    "bf16": (True, ["bf16.enabled"]),
    "fp16": (False, ["fp16.enabled"]),
    "hidden_size": (64, ["zero_optimization.stage3_param_persistence_threshold",
                         "zero_optimization.param_persistence_threshold"]),
}

# Configs that cannot train here: (the key the error names, words of the
# fix it gives).
_EXPECTED = {
    # DeepSpeed features zero_jax does not implement (and an enabled
    # TensorBoard monitor).
    "deepspeed__deepspeed_bsz24_fp16_eigenvalue_quantize_config.json": (
        "eigenvalue", "does not implement"),
    # Written for fewer GPUs: train_batch_size = micro x accumulation x 8
    # devices has no solution (DeepSpeed refuses it on 8 GPUs too).
    "megatron_deepspeed__universal_checkpointing_ds_config.json": (
        "train_batch_size", "not divisible"),
    "dsexamples__cifar_ds_config.json": ("train_batch_size", "not divisible"),
    "deepspeed__ds_config_func_scheduler.json": (
        "train_batch_size", "not divisible"),
    # 1-bit Adam compresses DeepSpeed's all-reduce.
    "dsexamples__deepspeed_bsz4k_onebitadam_config_seq128_nccl.json": (
        "optimizer.type", "\"type\": \"Adam\""),
}


def _at(config, path):
  node = config
  for part in path.split("."):
    if not isinstance(node, dict):
      return None
    node = node.get(part)
  return node


def _trainer_keywords(config):
  return {word: value for word, (value, keys) in _TRAINER.items()
          if any(_at(config, k) == "auto" for k in keys)}


@pytest.fixture(scope="module")
def mesh():
  return zj.make_mesh(num_devices=8)


def _params():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {"w1": jax.random.normal(k1, (16, 64)) * 0.3,
          "w2": jax.random.normal(k2, (64, 8)) * 0.1}


def _loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"].astype(batch["x"].dtype))
  return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def test_there_are_enough_configs_and_each_has_a_source():
  assert len(_FILES) >= 15, _FILES
  sources = (_DATA / "SOURCES.md").read_text(encoding="utf-8")
  missing = [f.name for f in _FILES if f.name not in sources]
  assert not missing, f"SOURCES.md does not list {missing}"
  assert set(_EXPECTED) <= {f.name for f in _FILES}
  # At least 90% train (each failure above is one zero_jax must refuse, or
  # a batch written for fewer GPUs).
  assert len(_EXPECTED) <= 0.1 * len(_FILES), sorted(_EXPECTED)


@pytest.mark.parametrize("path", _FILES, ids=[f.stem for f in _FILES])
def test_real_config_trains_one_step_or_names_the_key(path, mesh):
  config = json.loads(path.read_text(encoding="utf-8"))
  known = _trainer_keywords(config)
  # Without an optimizer section the Trainer builds its own AdamW; a
  # config scheduler then drives its learning rate (a factory of it).
  tx = (None if "optimizer" in config else
        optax.adamw if "scheduler" in config else optax.adamw(1e-3))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # (no-effect keys, deprecations)
    if path.name in _EXPECTED:
      key, fix = _EXPECTED[path.name]
      with pytest.raises(ValueError, match=key) as info:
        zj.initialize(_loss, _params(), path, mesh, tx, **known)
      assert fix in str(info.value)
      return
    engine, state = zj.initialize(_loss, _params(), path, mesh, tx, **known)
  before = jax.tree.map(np.asarray, engine.gather_params(state))
  n = engine.train_batch_size or 8 * engine.grad_accum_steps
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(n, 16)).astype(np.float32),
           "y": rng.normal(size=(n, 8)).astype(np.float32)}
  # (Three steps: DeepSpeed's log warmup gives the first two updates the
  # rate warmup_min_lr, 0 as the Trainer fills it.)
  for _ in range(3):
    state, metrics = engine.step(state, batch)
    assert np.isfinite(float(metrics["loss"])), path.name
  after = engine.gather_params(state)
  changed = [not np.allclose(np.asarray(a), b) for a, b in zip(
      jax.tree.leaves(after), jax.tree.leaves(before))]
  assert all(changed), (path.name, metrics)
