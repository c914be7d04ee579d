"""Every ZeRO stage, device count and optimizer matches single-device optax.

The grid (model x stage x devices x optimizer, and the hierarchical mesh's
model x stage x optimizer) runs pairwise by default: every pair of values
of any two of its parameters that the grid has is trained once, so every
stage meets every mesh, every optimizer and both models; the rest of the
grid is marked ``exhaustive`` (``pytest -m exhaustive``).
"""

import jax
import pytest

import zero_jax as zj
from tests import _models as m
from tests.train import _shared
from zero_jax.layout._plan import flat

STAGES = [0, 1, 2, 3]
DEVICES = [1, 2, 4, 8]
# The optimizers in a fixed order, for the checkerboard below.
OPTS = sorted(m.OPTIMIZERS)


def _cases():
  # The MLP runs every optimizer on 4 and 8 devices, and adamw on 1 and 2
  # as well. The GPT (the slow one to compile) runs adamw, a global norm
  # (clip_adam) and factored statistics (adafactor) on 8 devices and adamw
  # on 1: what depends on N is the layout and the collectives, not the
  # optimizer, and the MLP covers every N and optimizer.
  for model in sorted(m.MODELS):
    for stage in STAGES:
      for n in DEVICES:
        for opt in OPTS:
          if (n != 8 and opt != "adamw" and
              (model == "gpt" or n in (1, 2))):
            continue
          if model == "gpt" and opt in ("lion", "sgd_momentum"):
            continue
          if model == "gpt" and n in (2, 4):
            continue
          yield model, stage, n, opt


# The GPT of the default run: every stage on 8 devices (its scanned layers
# gathered one at a time at stage 3), each of its optimizers, and 1 device.
_GPT_DEFAULT = {(0, 8, "adafactor"), (1, 8, "adamw"), (2, 8, "adafactor"),
                (3, 8, "clip_adam"), (3, 1, "adamw")}


def _default(model, stage, n, opt):
  if model == "gpt":
    return (stage, n, opt) in _GPT_DEFAULT
  # The MLP: every stage on 1 and 2 devices; on 4 and 8 a checkerboard of
  # stage x optimizer (each pair on one of them, each N every optimizer
  # and every stage).
  return n in (1, 2) or (stage + OPTS.index(opt)) % 2 == (n == 8)


def _params(cases, default):
  return [pytest.param(*c, marks=() if default(*c) else
                       pytest.mark.exhaustive) for c in cases]


def _train(model, stage, opt, mesh):
  """Trains ``model`` with ``opt`` at ``stage`` on ``mesh``, asserts that it
  matches single-device optax; the engine and its final state."""
  # (The GPT for _shared.GPT_STEPS steps, the MLP for its 10.)
  steps = _shared.GPT_STEPS if model == "gpt" else _shared.MODEL_STEPS
  loss_fn, params, batches = _shared.setup(model, steps)
  ref_losses, ref_params = _shared.reference(model, opt, steps)
  # min_shard_elements=0 shards every divisible leaf, however small.
  engine = zj.Engine(loss_fn, m.OPTIMIZERS[opt](m.LR_SCALE[model]),
                     zj.ZeroConfig(stage=stage, min_shard_elements=0), mesh)
  losses, params_out, state = m.train_engine(engine, params, batches)
  m.assert_matches(losses, params_out, ref_losses, ref_params)
  return engine, state


@pytest.mark.parametrize("model,stage,n,opt", _params(_cases(), _default))
def test_matches_single_device_optax(model, stage, n, opt):
  _train(model, stage, opt, zj.make_mesh(num_devices=n))


def _hierarchical_cases():
  # (The GPT at stages 1 and 3; the MLP at every stage.)
  return [(model, stage, opt) for model in sorted(m.MODELS)
          for stage in STAGES for opt in ("adamw", "clip_adam")
          if model == "mlp" or stage in (1, 3)]


def _hierarchical_default(model, stage, opt):
  # The GPT once per optimizer (its two stages); the MLP the rest of each
  # stage's pair of optimizers.
  gpt = {(1, "adamw"), (3, "clip_adam")}
  return ((stage, opt) in gpt) == (model == "gpt")


@pytest.mark.parametrize("model,stage,opt", _params(_hierarchical_cases(),
                                                    _hierarchical_default))
def test_hierarchical_mesh_matches_single_device_optax(model, stage, opt):
  # replica=2 x data=4: state sharded over 4 devices, replicated over 2
  # groups; gradient shards all-reduced across groups.
  mesh = zj.make_mesh(replica=2)
  assert dict(mesh.shape) == {"replica": 2, "data": 4}
  engine, state = _train(model, stage, opt, mesh)
  # Sharded leaves hold 1/4 of the leaf per device, not 1/8.
  for x, lp in zip(jax.tree.leaves(state.opt_state),
                   flat(engine.opt_plan.leaves)):
    if lp.sharded:
      assert x.sharding.shard_shape(x.shape) == lp.local_shape(4)


@pytest.mark.parametrize("cases,default", [
    (_cases, _default), (_hierarchical_cases, _hierarchical_default)])
def test_the_default_run_covers_each_grid_pairwise(cases, default):
  cases = list(cases())
  assert not _shared.uncovered_pairs(cases, [c for c in cases
                                             if default(*c)])
