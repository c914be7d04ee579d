"""Layout planning: every leaf shape is handled, and the report says how."""

import functools

import optax
import pytest

import zero_jax as zj
from zero_jax.layout import plan_leaf
from tests import _models as m


@pytest.mark.parametrize("shape,n,dim,reason", [
    ((64, 16), 8, 0, ""),
    ((16, 64), 8, 1, ""),
    ((13, 24), 8, 1, ""),            # only the divisible dim is used
    ((4, 64, 64), 8, 2, ""),         # ties go to the later dim
    ((7,), 8, None, "no dimension divisible by 8"),
    ((3, 5, 7), 2, None, "no dimension divisible by 2"),
    ((), 8, None, "scalar"),
    ((4,), 8, None, "no dimension divisible by 8"),   # smaller than N
])
def test_plan_leaf(shape, n, dim, reason):
  lp = plan_leaf(shape, n, stage=3, min_shard_elements=0)
  assert lp.dim == dim
  assert lp.reason == reason


def test_plan_leaf_threshold_and_stage0():
  assert plan_leaf((8, 8), 8, 3, min_shard_elements=100).reason == (
      "64 elements < min_shard_elements=100")
  assert plan_leaf((8, 8), 8, 3, min_shard_elements=64).dim == 1
  assert plan_leaf((64, 64), 8, 0, min_shard_elements=0).reason == "stage 0"


@functools.cache
def _awkward_reference():
  """Single-device optax on the awkward leaves, shared by every stage."""
  return m.train_reference(m.awkward_loss, optax.adam(1e-2),
                           m.awkward_params(), m.awkward_batches())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_awkward_leaves_train_and_are_reported(stage):
  params, batches = m.awkward_params(), m.awkward_batches()
  tx = optax.adam(1e-2)
  ref_losses, ref_params = _awkward_reference()
  engine = zj.Engine(m.awkward_loss, tx,
                     zj.ZeroConfig(stage=stage, min_shard_elements=0),
                     zj.make_mesh(num_devices=8))
  losses, out, state = m.train_engine(engine, params, batches)
  m.assert_matches(losses, out, ref_losses, ref_params)

  report = engine.describe()
  if stage == 0:
    assert set(engine.replicated_params()) == set(params)
  else:
    assert set(engine.replicated_params()) == {"v7", "t357", "scalar", "w"}
    assert "m13x24" in report and "sharded dim 1 -> (13, 3)" in report
    assert "scalar" in report and "replicated (scalar)" in report
    assert "replicated (no dimension divisible by 8)" in report
    # The master copy really is laid out as reported (stage 3 keeps it
    # sharded; stages 1-2 keep a replicated compute copy).
    shard = state.params["m13x24"].sharding.shard_shape((13, 24))
    assert shard == ((13, 3) if stage == 3 else (13, 24))


def test_optimizer_state_mirrors_params():
  params = m.mlp_params()
  engine = zj.Engine(m.mlp_loss, optax.adam(1e-3),
                     zj.ZeroConfig(stage=1, min_shard_elements=0),
                     zj.make_mesh(num_devices=8))
  state = engine.init(params)
  adam = state.opt_state[0]
  for k, p in params.items():
    want = engine.param_plan.leaves[k].local_shape(8)
    assert adam.mu[k].sharding.shard_shape(p.shape) == want
    assert adam.nu[k].sharding.shard_shape(p.shape) == want
  assert adam.count.sharding.is_fully_replicated


def test_small_leaves_replicated_by_default():
  engine = zj.Engine(m.mlp_loss, optax.sgd(0.1), zj.ZeroConfig(stage=3),
                     zj.make_mesh(num_devices=8))
  engine.init(m.mlp_params())
  # b1 (64 elements) and w3 (512) are below the default threshold of 1024;
  # w1 (exactly 1024) and w2 are sharded.
  assert engine.replicated_params() == ["b1", "w3"]
  assert "64 elements < min_shard_elements=1024" in engine.describe()
