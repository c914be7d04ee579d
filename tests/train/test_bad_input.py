"""Bad input to the engine ends in a clear error before it reaches XLA, and
non-finite gradients never reach the state."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zero_jax as zj
from zero_jax.train._hooks import ENV_HEARTBEAT_FILE
from tests import _models as m


@functools.cache
def _engine(stage=3, devices=8, tx=None, loss=m.mlp_loss, has_aux=False,
            **config):
  # One engine per configuration, shared by the tests that step it (each
  # from a state of its own): its step is traced and compiled once.
  return zj.Engine(loss, tx or optax.adamw(1e-2),
                   zj.ZeroConfig(stage=stage, min_shard_elements=0, **config),
                   zj.make_mesh(num_devices=devices), has_aux=has_aux)


def test_a_donated_state_is_an_error_not_a_crash():
  engine = _engine()
  state = engine.init(m.mlp_params())
  batch = m.mlp_batches(1)[0]
  new, _ = engine.step(state, batch)
  with pytest.raises(ValueError, match="donated to an earlier engine.step"):
    engine.step(state, batch)
  engine.step(new, batch)  # the returned state is the one to use


@pytest.mark.parametrize("other,match", [
    (dict(devices=4), "laid out on 4 device"),
    (dict(tx=optax.adam(1e-2), stage=0), "laid out on 8"),
    (dict(tx=optax.sgd(1e-2)), "state.opt_state does not have this engine's"),
    (dict(stage=1, compute_dtype="bfloat16"), "state.compute_params"),
])
def test_a_state_of_another_engine_names_the_difference(other, match):
  state = _engine(**other).init(m.mlp_params())
  engine = _engine()
  engine.init(m.mlp_params())
  with pytest.raises(ValueError, match=match) as e:
    engine.step(state, m.mlp_batches(1)[0])
  assert "Checkpointer" in str(e.value)


@pytest.mark.parametrize("x_rows,y_rows,match", [
    (64, 8, "different leading"), (64, 128, "different leading"),
    (0, 0, "0 examples")])
def test_batch_leaves_share_one_nonzero_leading_dimension(x_rows, y_rows,
                                                          match):
  engine = _engine()
  state = engine.init(m.mlp_params())
  batch = {"x": np.ones((x_rows, 16), np.float32),
           "y": np.ones((y_rows, 8), np.float32)}
  with pytest.raises(ValueError, match=match):
    engine.step(state, batch)
  engine.step(state, m.mlp_batches(1)[0])  # the state was not consumed


@pytest.mark.parametrize("returns,has_aux,match", [
    (lambda loss: loss.astype(jnp.int32), False, "floating-point scalar"),
    (lambda loss: loss > 0, False, "floating-point scalar"),
    (lambda loss: (loss, {"a": loss}), False, "has_aux=True"),
    (lambda loss: loss, True, "has_aux=True"),
    (lambda loss: jnp.stack([loss, loss]), False, "floating-point scalar"),
])
def test_loss_fn_returns_a_floating_scalar(returns, has_aux, match):
  engine = _engine(loss=lambda p, b: returns(m.mlp_loss(p, b)),
                   has_aux=has_aux)
  state = engine.init(m.mlp_params())
  with pytest.raises(TypeError, match=match):
    engine.step(state, m.mlp_batches(1)[0])


def test_a_python_float_parameter_trains():
  params = dict(m.mlp_params(), scale=1.5)
  loss = lambda p, b: m.mlp_loss({k: v for k, v in p.items()
                                  if k != "scale"}, b) * p["scale"]
  engine = _engine(loss=loss)
  state = engine.init(params)
  state, _ = engine.step(state, m.mlp_batches(1)[0])
  assert float(engine.gather_params(state)["scale"]) != 1.5


def _nan_batch():
  batch = m.mlp_batches(1, seed=3)[0]
  batch["x"][5, 3] = np.nan  # one example of one device's slice
  return batch


@pytest.mark.parametrize("stage,config", [
    (0, {}), (1, {}), (2, {}), (3, {}), (3, dict(compute_dtype="bfloat16")),
    (3, dict(offload_optimizer="host", compute_dtype="bfloat16")),
    (2, dict(offload_optimizer="host", update_on="host"))])
def test_a_nan_in_the_batch_skips_the_step_and_keeps_the_state(stage, config):
  engine = _engine(stage, **config)
  state = engine.init(m.mlp_params())
  state, metrics = engine.step(state, m.mlp_batches(1)[0])
  assert not bool(metrics["skipped"])
  before = jax.tree.map(np.asarray, (state.params, state.opt_state,
                                     state.compute_params))
  step = int(state.step)
  state, metrics = engine.step(state, _nan_batch())
  assert bool(metrics["skipped"]) and not np.isfinite(metrics["grad_norm"])
  assert int(state.step) == step + 1
  # The skip count (where the learning rate schedule is) moves, nothing else.
  assert int(metrics["skipped_steps"]) == int(state.loss_scale.skipped) == 1
  after = jax.tree.map(np.asarray, (state.params, state.opt_state,
                                    state.compute_params))
  for x, y in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
    np.testing.assert_array_equal(x, y)


def test_consecutive_skips_raise_and_a_finite_step_resets_the_count():
  engine = _engine(max_consecutive_skips=2)
  state = engine.init(m.mlp_params())
  good = m.mlp_batches(1)[0]
  for batch in (_nan_batch(), good, _nan_batch(), _nan_batch()):
    state, _ = engine.step(state, batch)
  with pytest.raises(FloatingPointError, match="max_consecutive_skips=2"):
    engine.step(state, good)


def test_without_skip_nonfinite_nan_propagates():
  engine = _engine(skip_nonfinite=False)
  state = engine.init(m.mlp_params())
  state, metrics = engine.step(state, _nan_batch())
  assert "skipped" not in metrics
  assert not np.isfinite(np.asarray(jax.tree.leaves(state.params)[0])).all()


def test_each_step_reports_progress_to_the_launchers_watchdog(
    monkeypatch, tmp_path):
  # The launcher names a file (mtime 0: no step yet); a step touches it.
  beat = tmp_path / "heartbeat0"
  beat.touch()
  os.utime(beat, ns=(0, 0))
  monkeypatch.setenv(ENV_HEARTBEAT_FILE, str(beat))
  calls = []
  remove = zj.train.add_step_listener(lambda: calls.append(1))
  try:
    engine = _engine()
    state = engine.init(m.mlp_params())
    for batch in m.mlp_batches(3):
      state, _ = engine.step(state, batch)
  finally:
    remove()
  assert len(calls) == 3
  assert beat.stat().st_mtime_ns > 0


# ------------------------------------------- batches on any device


def _on(batch, devices):
  """``batch`` as jax.Arrays committed to ``devices`` (replicated)."""
  sharding = jax.sharding.NamedSharding(
      jax.sharding.Mesh(np.array(devices), ("d",)),
      jax.sharding.PartitionSpec())
  return jax.tree.map(lambda x: jax.device_put(x, sharding), batch)


@pytest.mark.parametrize("first,last,mesh_devices", [
    (0, 1, 8),  # a data loader's default device
    (4, 8, 8),  # part of the mesh, replicated
    (4, 5, 4),  # a device outside the (first 4 devices') mesh
])
def test_a_batch_committed_to_other_devices_is_placed_on_the_mesh(
    first, last, mesh_devices):
  devices = lambda: jax.devices()[first:last]
  batches = m.mlp_batches(2)
  engine = _engine(devices=mesh_devices)
  state = engine.init(m.mlp_params())
  got = []
  for batch in batches:
    state, metrics = engine.step(state, _on(batch, devices()))
    got.append(float(metrics["loss"]))
  # The same steps as from host (numpy) batches.
  state = engine.init(m.mlp_params())
  for batch, loss in zip(batches, got):
    state, metrics = engine.step(state, batch)
    assert float(metrics["loss"]) == pytest.approx(loss, rel=1e-6)


def test_a_batch_laid_out_as_the_step_takes_it_is_not_copied():
  engine = _engine()
  batch = engine.shard_batch(m.mlp_batches(1)[0])
  for x in jax.tree.leaves(batch):
    assert x.sharding.is_equivalent_to(engine.batch_sharding, x.ndim)
  placed = engine.shard_batch(batch)
  for x, y in zip(jax.tree.leaves(placed), jax.tree.leaves(batch)):
    assert x is y


def test_in_several_processes_a_local_jax_array_batch_names_local_batch():
  # (Built by the function the engine raises with when
  # jax.process_count() > 1 and a leaf is on this process's devices only.)
  engine = _engine()
  x = jax.device_put(np.ones((64, 16), np.float32), jax.devices()[0])
  message = engine.batch.foreign_batch_error("['x']", x.sharding, 2)
  assert "zero_jax.distributed.local_batch" in message
  assert "['x']" in message and "2 processes" in message
  assert "engine.batch_sharding" in message
