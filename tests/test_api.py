"""The public API behaves as a user of DeepSpeed or FSDP would expect."""

import functools
import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from tests import _models as m


def _engine(stage=3, n=8, tx=None, **kw):
  return zj.Engine(m.mlp_loss, tx or optax.adam(1e-2),
                   zj.ZeroConfig(stage=stage, min_shard_elements=0),
                   zj.make_mesh(num_devices=n), **kw)


def test_params_already_on_the_mesh_are_copied_too():
  engine = _engine(3)
  params = jax.device_put(m.mlp_params(), engine.mesh.devices.flat[0])
  state = engine.init(params)
  state, _ = engine.step(state, m.mlp_batches(1)[0])
  np.asarray(params["w1"])  # still readable: not donated


def test_step_is_jitted_and_lowerable():
  # (A reduce-scatter on CPU is the per-device step's own collective: the
  # global step's are the compiler's, tests/train/test_loss_scope.py's.)
  engine = zj.Engine(m.mlp_loss, optax.adam(1e-2),
                     zj.ZeroConfig(stage=3, min_shard_elements=0,
                                   loss_scope="per_device"),
                     zj.make_mesh(num_devices=8))
  state = engine.init(m.mlp_params())
  batch = m.mlp_batches(1)[0]
  compiled = engine.step.lower(state, batch).compile()
  assert "reduce-scatter" in compiled.as_text()
  # (Its outputs are named: the step's internal overflow flag is None
  # here, without float16 loss scaling, and never among the metrics.)
  out = compiled(state, engine.shard_batch(batch))
  assert set(out.metrics) == {"loss", "grad_norm", "skipped",
                              "skipped_steps"}
  assert out.overflow_at_min is None and out.grads is None
  assert int(out.state.step) == 1
  with pytest.raises(RuntimeError, match="donated|deleted"):
    np.asarray(state.params["w1"])  # the old state was donated


def test_layouts_stay_fixed_so_steps_never_recompile():
  engine = _engine(2)
  state = engine.init(m.mlp_params())
  for b in m.mlp_batches(4):
    state, _ = engine.step(state, b)
  assert engine.step.jitted._cache_size() == 1
  flat = jax.tree.leaves(state)
  want = jax.tree.leaves(engine.state_shardings)
  assert [x.sharding for x in flat] == want


def test_batch_not_divisible_names_both_numbers():
  engine = _engine(3)
  state = engine.init(m.mlp_params())
  bad = m.mlp_batches(1, batch=30)[0]
  with pytest.raises(ValueError, match=r"global batch size 30 .* 8 devices"):
    engine.step(state, bad)
  # Global jax arrays are checked too (when the step is traced).
  bad = jax.tree.map(jnp.asarray, bad)
  with pytest.raises(ValueError, match=r"global batch size 30 .* 8 devices"):
    engine.step.lower(state, bad)


def test_config_errors_name_the_fix():
  with pytest.raises(ValueError, match="stage must be one of"):
    zj.ZeroConfig(stage=4)
  with pytest.raises(ValueError, match="unknown ZeroConfig key"):
    zj.ZeroConfig.from_dict({"stage": 2, "offload_cpu": True})
  assert zj.ZeroConfig.from_dict({"stage": 2}).stage == 2
  with pytest.raises(ValueError, match="num_devices=99"):
    zj.make_mesh(num_devices=99)
  engine = _engine(3)
  with pytest.raises(RuntimeError, match=r"engine.init"):
    engine.step(None, m.mlp_batches(1)[0])
  with pytest.raises(TypeError, match="nnx.split"):
    engine.init({"w": jnp.zeros((8, 8)), "n": jnp.zeros((8,), jnp.int32)})


@pytest.mark.parametrize("stage", [0, 3])
def test_aux_is_averaged_over_devices(stage):
  def loss_fn(p, b):
    return m.mlp_loss(p, b), {"x_mean": jnp.mean(b["x"]),
                              "first": b["x"][0, 0]}

  # (Aux averaged over the devices' slices is the per-device loss's
  # meaning; the global loss's aux is tests/train/test_loss_scope.py's.)
  engine = zj.Engine(loss_fn, optax.sgd(0.1),
                     zj.ZeroConfig(stage=stage, loss_scope="per_device"),
                     zj.make_mesh(num_devices=8), has_aux=True)
  batch = m.mlp_batches(1)[0]
  _, metrics = engine.step(engine.init(m.mlp_params()), batch)
  np.testing.assert_allclose(metrics["aux"]["x_mean"], batch["x"].mean(),
                             rtol=1e-5)
  # The first example of each device's slice (32 / 8 = 4 per device).
  np.testing.assert_allclose(metrics["aux"]["first"],
                             batch["x"][::4, 0].mean(), rtol=1e-5)


def test_rng_differs_per_step_and_per_device():
  def loss_fn(p, b, key):
    return m.mlp_loss(p, b), {"u": jax.random.uniform(key)}

  # (A key per device is the per-device loss's; the global loss's one key
  # a step is tests/train/test_loss_scope.py's.)
  config = zj.ZeroConfig(stage=3, seed=7, loss_scope="per_device")
  engine = zj.Engine(loss_fn, optax.sgd(0.1), config,
                     zj.make_mesh(num_devices=8), has_aux=True, with_rng=True)
  state = engine.init(m.mlp_params())
  got = []
  for b in m.mlp_batches(2):
    state, metrics = engine.step(state, b)
    got.append(float(metrics["aux"]["u"]))
  # Documented derivation: fold_in(fold_in(PRNGKey(seed), step), device).
  base = jax.random.PRNGKey(7)
  for step in range(2):
    k = jax.random.fold_in(base, step)
    us = [float(jax.random.uniform(jax.random.fold_in(k, d)))
          for d in range(8)]
    assert len(set(us)) == 8
    np.testing.assert_allclose(got[step], np.mean(us), rtol=1e-6)
  assert got[0] != got[1]


def test_gather_params_keeps_the_callers_dtypes():
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), m.mlp_params())
  engine = _engine(3, tx=optax.sgd(1e-2))
  state = engine.init(params)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
  state, _ = engine.step(state, m.mlp_batches(1)[0])
  full = engine.gather_params(state)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(full))
  assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(full))


class _LinenMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.tanh(nn.Dense(64)(x))
    x = nn.tanh(nn.Dense(64)(x))
    return nn.Dense(8)(x)


@functools.cache
def _linen_reference():
  model = _LinenMLP()
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 16)))["params"]

  def loss_fn(p, b):
    return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

  batches = m.mlp_batches(5)
  tx = optax.adamw(1e-2)
  return loss_fn, tx, params, batches, m.train_reference(loss_fn, tx, params,
                                                         batches)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_flax_linen_params_plus_apply_and_one_tree_seeds_many_engines(stage):
  loss_fn, tx, params, batches, ref = _linen_reference()
  before = jax.tree.map(np.array, params)
  engine = lambda: zj.Engine(loss_fn, tx,
                             zj.ZeroConfig(stage=stage, min_shard_elements=0),
                             zj.make_mesh(num_devices=8))
  losses, out, _ = m.train_engine(engine(), params, batches)
  m.assert_matches(losses, out, *ref)
  # init copies the parameters: the caller's arrays survived the donating
  # steps, unchanged...
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(before)):
    np.testing.assert_array_equal(np.asarray(x), y)
  # ...and seed a second engine to the same result.
  assert m.train_engine(engine(), params, batches)[0] == losses


def test_the_top_level_api_is_the_curated_list_and_nothing_else():
  # Internals live in their subpackage (zero_jax.layout.Plan, ...); the top
  # level names what most scripts need.
  assert zj.__all__ == [
      "Accumulation", "Activations", "Batch",
      "CheckpointConflictError", "CheckpointCorruptError",
      "CheckpointWriteError", "Checkpointer", "Engine",
      "LossScaleState", "LossScaling", "LossScope", "MixedPrecision",
      "NvmeOptions", "Offload", "REMAT_POLICIES", "RematPolicy",
      "StepFailedError", "StepPlan", "Tier",
      "TrainState", "UpdateOn",
      "ZeroConfig", "ZeroPP", "analysis", "checkpoint_name", "distributed",
      "estimate_activations", "estimate_comm", "estimate_memory",
      "export_params", "from_deepspeed", "initialize", "layer",
      "load_params",
      "make_mesh", "metrics", "models", "scan_layers", "scan_linen",
      "scan_nnx", "simulate_cpu_devices"]
  for name in zj.__all__:
    assert getattr(zj, name) is not None
  for name in ("Plan", "plan_leaf", "remat_policy"):
    with pytest.raises(AttributeError, match=f"no attribute {name!r}"):
      getattr(zj, name)
  assert zj.layout.Plan is not None and zj.layers.remat_policy is not None
