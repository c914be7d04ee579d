"""Every ZeRO stage, device count and optimizer matches single-device optax."""

import pytest

import zero_jax as zj
from tests import _models as m

STAGES = [0, 1, 2, 3]
DEVICES = [1, 2, 4, 8]


@pytest.mark.parametrize("opt", sorted(m.OPTIMIZERS))
@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("model", sorted(m.MODELS))
def test_matches_single_device_optax(model, stage, n, opt):
  loss_fn, params, batches = m.MODELS[model]()
  ref_losses, ref_params = m.cached_reference(model, opt)
  # min_shard_elements=0 shards every divisible leaf, however small.
  engine = zj.Engine(loss_fn, m.OPTIMIZERS[opt](m.LR_SCALE[model]),
                     zj.ZeroConfig(stage=stage, min_shard_elements=0),
                     zj.make_mesh(num_devices=n))
  losses, params_out, _ = m.train_engine(engine, params, batches)
  m.assert_matches(losses, params_out, ref_losses, ref_params)
