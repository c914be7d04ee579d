"""Every ZeRO stage, device count and optimizer matches single-device optax."""

import jax
import pytest

import zero_jax as zj
from tests import _models as m
from zero_jax import layout

STAGES = [0, 1, 2, 3]
DEVICES = [1, 2, 4, 8]


def _cases():
  # The MLP runs every optimizer on 4 and 8 devices, and adamw on 1 and 2
  # as well. The GPT (the slow one to compile) runs adamw, a global norm
  # (clip_adam) and factored statistics (adafactor) on 8 devices and adamw
  # on 1: what depends on N is the layout and the collectives, not the
  # optimizer, and the MLP covers every N and optimizer.
  for model in sorted(m.MODELS):
    for stage in STAGES:
      for n in DEVICES:
        for opt in sorted(m.OPTIMIZERS):
          if (n != 8 and opt != "adamw" and
              (model == "gpt" or n in (1, 2))):
            continue
          if model == "gpt" and opt in ("lion", "sgd_momentum"):
            continue
          if model == "gpt" and n in (2, 4):
            continue
          yield model, stage, n, opt


@pytest.mark.parametrize("model,stage,n,opt", list(_cases()))
def test_matches_single_device_optax(model, stage, n, opt):
  loss_fn, params, batches = m.MODELS[model]()
  ref_losses, ref_params = m.cached_reference(model, opt)
  # min_shard_elements=0 shards every divisible leaf, however small.
  engine = zj.Engine(loss_fn, m.OPTIMIZERS[opt](m.LR_SCALE[model]),
                     zj.ZeroConfig(stage=stage, min_shard_elements=0),
                     zj.make_mesh(num_devices=n))
  losses, params_out, _ = m.train_engine(engine, params, batches)
  m.assert_matches(losses, params_out, ref_losses, ref_params)


@pytest.mark.parametrize("model,stage,opt", [
    (model, stage, opt) for model in sorted(m.MODELS) for stage in STAGES
    for opt in ("adamw", "clip_adam")
    # (The GPT at stages 1 and 3; the MLP at every stage.)
    if model == "mlp" or stage in (1, 3)])
def test_hierarchical_mesh_matches_single_device_optax(model, stage, opt):
  # replica=2 x data=4: state sharded over 4 devices, replicated over 2
  # groups; gradient shards all-reduced across groups.
  loss_fn, params, batches = m.MODELS[model]()
  ref_losses, ref_params = m.cached_reference(model, opt)
  mesh = zj.make_mesh(replica=2)
  assert dict(mesh.shape) == {"replica": 2, "data": 4}
  engine = zj.Engine(loss_fn, m.OPTIMIZERS[opt](m.LR_SCALE[model]),
                     zj.ZeroConfig(stage=stage, min_shard_elements=0), mesh)
  losses, params_out, state = m.train_engine(engine, params, batches)
  m.assert_matches(losses, params_out, ref_losses, ref_params)
  # Sharded leaves hold 1/4 of the leaf per device, not 1/8.
  for x, lp in zip(jax.tree.leaves(state.opt_state),
                   layout.flat(engine.opt_plan.leaves)):
    if lp.sharded:
      assert x.sharding.shard_shape(x.shape) == lp.local_shape(4)
