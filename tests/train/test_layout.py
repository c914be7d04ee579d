"""The train step's layout: built once, frozen, and all the step needs.

``Engine`` is a facade: the same training runs from a ``StepPlan`` and the
pure functions of ``zero_jax.train`` alone, and gives the engine's numbers.
"""

import dataclasses

import jax
import numpy as np
import optax
import pytest

import zero_jax as zj
from tests import _models as m
from zero_jax import layout as zl
from zero_jax import train


def _config(**kw):
  return zj.ZeroConfig(stage=3, min_shard_elements=0, **kw)


def test_the_step_is_a_function_of_layout_loss_state_and_batch():
  mesh = zj.make_mesh()
  tx = optax.adamw(1e-2)
  params, batches = m.mlp_params(), m.mlp_batches(3)
  layout = zj.StepPlan.build(zl.decide(_config(), mesh), mesh, params, tx)
  step = train.jit_step(layout, train.Loss(m.mlp_loss))
  state = layout.update.init(layout, params)
  losses = []
  for b in batches:
    b = jax.device_put(b, layout.batch.sharding)
    state, metrics, flag, _ = step(state, b)
    losses.append(float(metrics["loss"]))
  assert flag is None  # (no float16 loss scaling)
  engine = zj.Engine(m.mlp_loss, tx, _config(), mesh)
  ref_losses, ref_params, _ = m.train_engine(engine, params, batches)
  assert losses == ref_losses
  for got, want in zip(jax.tree.leaves(state.params),
                       jax.tree.leaves(ref_params)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_layout_is_frozen_and_built_once_per_parameter_shapes():
  engine = zj.Engine(m.mlp_loss, optax.adam(1e-3), _config(),
                     zj.make_mesh())
  state = engine.init(m.mlp_params())
  layout = engine.layout
  with pytest.raises(dataclasses.FrozenInstanceError):
    layout.remat = zj.RematPolicy.NONE
  engine.step(state, m.mlp_batches(1)[0])
  # A restore target of the same parameters reuses the layout (and so the
  # compiled step); other shapes get a layout of their own.
  engine.abstract_state(m.mlp_params())
  assert engine.layout is layout
  engine.init(m.awkward_params())
  assert engine.layout is not layout


@pytest.mark.parametrize("config,strategy,kind", [
    (dict(), train.OnDevice, zl.UpdateKind.DEVICE),
    (dict(offload_optimizer="host"), train.Streamed, zl.UpdateKind.STREAMED),
    (dict(offload_optimizer="host", update_on="host"), train.OnHost,
     zl.UpdateKind.HOST)])
def test_one_update_strategy_per_placement(config, strategy, kind):
  engine = zj.Engine(m.mlp_loss, optax.adam(1e-3), _config(**config),
                     zj.make_mesh())
  engine.abstract_state(m.mlp_params())
  assert engine.placement.update is kind
  assert type(engine.layout.update) is strategy
  assert engine.layout.update.kind is kind


def test_placement_decisions_are_enums():
  pl = zl.decide_placement(_config(compute_dtype="bfloat16",
                               offload_optimizer="host"))
  assert pl.compute_copy is zl.ComputeCopy.SHARDED
  assert pl.gather_from is zl.GatherFrom.COMPUTE
  assert pl.master_memory is zl.Memory.PINNED_HOST
  assert pl.materialize is zl.Materialize.GATHER_FROM
  assert pl.update is zl.UpdateKind.STREAMED
  assert pl.grads_on_host
  # (Either loss: at stage 3 the engine hands a global loss's leaves over
  # too, and sends their gradient shards to host memory.)
  assert zl.decide_placement(_config(
      compute_dtype="bfloat16", offload_optimizer="host",
      loss_scope="per_device")).grads_on_host
  host = zl.decide_placement(_config(offload_params="host", update_on="host"))
  assert host.master_memory is zl.Memory.HOST_CPU
  assert host.gather_from is zl.GatherFrom.HOST_COMPUTE
  assert host.gathers_from_host


def test_a_mesh_axis_the_engine_does_not_use_is_an_error():
  devices = np.array(jax.devices()[:8]).reshape(4, 2)
  mesh = jax.sharding.Mesh(devices, ("data", "tensor"))
  with pytest.raises(ValueError, match="'tensor'.*repeat the same work"):
    zj.Engine(m.mlp_loss, optax.adam(1e-3), _config(), mesh)
  # 'model' is tensor parallelism's axis: parameters none of which the
  # model splits over it would repeat the same work there too.
  mesh = jax.sharding.Mesh(devices, ("data", "model"))
  engine = zj.Engine(m.mlp_loss, optax.adam(1e-3), _config(), mesh)
  with pytest.raises(ValueError, match="'model'.*repeat the same work"):
    engine.init(m.mlp_params())


def test_remat_auto_compiles_each_candidate_program_once(monkeypatch):
  # A second engine for the same step (a sweep, a rebuilt engine) finds
  # the candidates' compiled peaks instead of compiling them again.
  compiles = []
  original = jax.stages.Lowered.compile

  def counted(self, *args, **kwargs):
    compiles.append(self)
    return original(self, *args, **kwargs)

  monkeypatch.setattr(jax.stages.Lowered, "compile", counted)
  reasons = []
  for _ in range(2):
    engine = zj.Engine(m.mlp_loss, optax.adam(1e-3),
                       zj.ZeroConfig(stage=3, remat="auto",
                                     device_memory_bytes=2**30),
                       zj.make_mesh())
    state = engine.init(m.mlp_params())
    batch = engine.shard_batch(m.mlp_batches(1)[0])
    before = len(compiles)
    engine.choose_remat(state, batch)
    reasons.append((len(compiles) - before, engine.remat_reason))
  (first, why), (second, why_again) = reasons
  assert first >= 1 and second == 0 and why_again == why, reasons
