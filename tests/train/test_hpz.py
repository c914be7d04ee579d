"""ZeRO++'s hpZ (``ZeroConfig.hpz_partition_size``) on 8 CPU devices, a
``(replica=2, data=4)`` mesh: trains as single-device optax does, keeps
every state leaf sharded over all 8 devices, and refuses what it does not
do. (What crosses the groups, compiled for GPUs: tests/analysis/
test_gpu_hpz.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zero_jax as zj
from tests import _models as m
from tests.train import _shared
from zero_jax import config as zconfig
from zero_jax.layout._plan import flat


# Steps per model: the MLP's 10 of tests/_models, the GPT's 3 (enough for
# Adam's moments to matter; each of its steps costs about what the MLP's
# engine costs to compile).
STEPS = {"mlp": _shared.MODEL_STEPS, "gpt": _shared.GPT_STEPS}


def _engine(model="gpt", opt="adamw", mesh=None, **fields):
  loss_fn, params, batches = _shared.setup(model, STEPS[model])
  fields = {"stage": 3, "min_shard_elements": 0, "hpz_partition_size": 4,
            **fields}
  engine = zj.Engine(loss_fn, m.OPTIMIZERS[opt](m.LR_SCALE[model]),
                     zj.ZeroConfig(**fields),
                     mesh or zj.make_mesh(replica=2))
  return engine, params, batches


@pytest.mark.parametrize("model,opt", [("mlp", "adamw"), ("gpt", "adamw"),
                                       ("gpt", "clip_adam")])
def test_hpz_matches_single_device_optax(model, opt):
  ref_losses, ref_params = _shared.reference(model, opt, STEPS[model])
  engine, params, batches = _engine(model, opt)
  losses, params_out, state = m.train_engine(engine, params, batches)
  m.assert_matches(losses, params_out, ref_losses, ref_params)
  # The primary partition: every sharded leaf of the master and of the
  # optimizer state holds 1/8 per device (MiCS's replica groups: 1/4).
  assert engine.n == 8
  for tree, plan in ((state.params, engine.param_plan),
                     (state.opt_state, engine.opt_plan)):
    sharded = [(x, lp) for x, lp in zip(jax.tree.leaves(tree),
                                        flat(plan.leaves))
               if lp.sharded]
    assert sharded
    for x, lp in sharded:
      assert lp.hierarchical
      assert x.sharding.shard_shape(x.shape) == lp.local_shape(8)
  assert "hpZ" in engine.describe()


def test_hpz_in_bf16_matches_the_flat_layout():
  # The same bf16 parameters are used; the gradients are summed in float32
  # over the group, then across groups, rather than over all 8 at once.
  # (Float32 sums of bf16 gradients are the per-device step's; the global
  # loss sums in bf16, whose order the two layouts change.)
  flat, params, batches = _engine(compute_dtype="bfloat16",
                                  hpz_partition_size=1,
                                  loss_scope="per_device",
                                  mesh=zj.make_mesh(num_devices=8))
  hpz, _, _ = _engine(compute_dtype="bfloat16", loss_scope="per_device")
  ref_losses, ref_params, _ = m.train_engine(flat, params, batches)
  losses, out, state = m.train_engine(hpz, params, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  m.assert_matches(losses, out, ref_losses, ref_params, tol=1e-4)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))


def test_hpz_with_quantized_gathers_and_gradients_tracks_optax():
  # qwZ's int8 blocks cross the groups and are kept as the secondary copy;
  # qgZ's int8 gradient blocks are summed at both levels (qgZ: the
  # per-device step's own collectives).
  ref_losses, ref_params = _shared.reference("gpt", "adamw", STEPS["gpt"])
  engine, params, batches = _engine(quantized_weights=True,
                                    quantized_gradients=True,
                                    loss_scope="per_device")
  losses, out, _ = m.train_engine(engine, params, batches)
  loss_err = max(abs(l - r) / r for l, r in zip(losses, ref_losses))
  err = m.rel_err(out, ref_params)
  assert loss_err <= 5e-4, loss_err
  assert 1e-4 < err, err  # quantized, not exact


@pytest.mark.parametrize("fields,match", [
    ({"stage": 2}, "stage=3"),
    ({"offload_optimizer": "host"}, "offload"),
    ({"offload_params": "host"}, "offload"),
    ({"prefetch": True}, "prefetch"),
])
def test_hpz_refuses_what_it_does_not_do(fields, match):
  with pytest.raises(ValueError, match=match):
    zj.ZeroConfig(**{"stage": 3, "hpz_partition_size": 4, **fields})


@pytest.mark.parametrize("mesh_args,fix", [
    ({}, r"make_mesh\(replica=2\)"),  # no replica axis
    ({"replica": 4}, r"make_mesh\(replica=2\)"),  # groups of 2, not 4
    ({"replica": 2, "model": 2}, r"make_mesh\(replica=2\)"),
])
def test_hpz_needs_a_mesh_of_its_groups(mesh_args, fix):
  with pytest.raises(ValueError, match=fix):
    _engine(mesh=zj.make_mesh(**mesh_args))[0].init(
        _shared.setup("gpt", STEPS["gpt"])[1])


def test_deepspeed_key_maps_to_hpz():
  cfg = zconfig.from_deepspeed({"zero_optimization": {
      "stage": 3, "zero_hpz_partition_size": 8}})
  assert cfg.hpz_partition_size == 8
  with pytest.raises(ValueError, match="zero_hpz_partition_size"):
    zconfig.from_deepspeed({"zero_optimization": {
        "stage": 3, "zero_hpz_partition_size": 0}})


def test_an_hpz_checkpoint_restores_on_a_flat_mesh_and_back(tmp_path):
  # The state is global arrays: hpZ's layout is only where the shards are.
  hpz, params, batches = _engine("mlp")
  flat, _, _ = _engine("mlp", hpz_partition_size=1,
                       mesh=zj.make_mesh(num_devices=8))
  state, _ = m.run_steps(hpz, hpz.init(params), batches[:5])
  with zj.Checkpointer(tmp_path / "hpz") as ckpt:
    ckpt.save(state, engine=hpz)
  with zj.Checkpointer(tmp_path / "hpz") as ckpt:
    moved = ckpt.restore(flat, params)
  _, cont_losses = m.run_steps(hpz, state, batches[5:])
  moved, moved_losses = m.run_steps(flat, moved, batches[5:])
  np.testing.assert_allclose(moved_losses, cont_losses, rtol=1e-6)
  with zj.Checkpointer(tmp_path / "flat") as ckpt:
    ckpt.save(moved, engine=flat)
  with zj.Checkpointer(tmp_path / "flat") as ckpt:
    back = ckpt.restore(hpz, params)
  for x, sh in zip(jax.tree.leaves(back), jax.tree.leaves(
      hpz.state_shardings)):
    assert x.sharding.is_equivalent_to(sh, x.ndim)
