"""Checkpoints of tensor-parallel runs restore across mesh shapes: (data 4,
model 2) -> (data 8) -> (data 2, model 4), at every stage, bit-identical
in parameters and optimizer state, and training on equals single-device
optax."""

import functools

import jax
import numpy as np
import optax
import pytest

import zero_jax as zj
from tests import _models as m
from tests import _tp_models as tpm
from zero_jax.layout import DATA, MODEL

TX = optax.adamw(1e-2, weight_decay=0.1)
# Steps on each mesh, in order: 2 on (data 4, model 2), 1 on (data 8), 1 on
# (data 2, model 4).
BATCHES = tpm.tp_batches(4)


@functools.cache
def _reference():
  return m.train_reference(tpm.nnx_loss, TX, tpm.nnx_init(), BATCHES)


def _engine(stage: int, model: int) -> zj.Engine:
  config = zj.ZeroConfig(stage=stage, min_shard_elements=0)
  return zj.Engine(tpm.nnx_loss, TX, config, zj.make_mesh(model=model))


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _assert_bit_identical(got, want, what: str) -> None:
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  pairs = zip(jax.tree_util.tree_flatten_with_path(got)[0],
              jax.tree.leaves(want))
  for (path, x), y in pairs:
    name = f"{what}{jax.tree_util.keystr(path)}"
    assert x.dtype == y.dtype and x.shape == y.shape, name
    assert np.array_equal(x, y), (
        f"{name} differs after the round trip: max abs diff "
        f"{np.max(np.abs(x.astype(np.float64) - y)):.3g}")


def _axes(x: jax.Array) -> set[str]:
  """The mesh axes a leaf's sharding names."""
  return {a for e in x.sharding.spec if e is not None
          for a in ((e,) if isinstance(e, str) else e)}


def _restore(ckpt, engine, saved, saved_opt, step):
  """Restores the latest checkpoint into ``engine``; checks that it is the
  saved state, bit for bit, in this engine's layout."""
  state = ckpt.restore(engine, tpm.nnx_init())
  assert int(state.step) == step
  _assert_bit_identical(_host(engine.gather_params(state)), saved, "params")
  # Adam's count, mu and nu: the moments come back as saved, too.
  _assert_bit_identical(_host(state.opt_state), saved_opt, "opt_state")
  for leaf, sh in zip(jax.tree.leaves(state),
                      jax.tree.leaves(engine.state_shardings)):
    assert leaf.sharding.is_equivalent_to(sh, leaf.ndim)
  return state


# (save stage, first restore's stage, second restore's stage).
# A Latin square: every stage saves, restores first and restores second
# once, each time into another stage.
STAGES = [(0, 2, 3), (1, 3, 0), (2, 0, 1), (3, 1, 2)]


@pytest.mark.parametrize("stages", STAGES,
                         ids=["-".join(map(str, s)) for s in STAGES])
def test_round_trips_across_mesh_shapes(tmp_path, stages):
  first, second, third = stages
  ref_losses, ref_params = _reference()
  with zj.Checkpointer(tmp_path) as ckpt:
    engine = _engine(first, model=2)
    state, losses = m.run_steps(engine, engine.init(tpm.nnx_init()),
                                BATCHES[:2])
    assert any(MODEL in _axes(x) for x in jax.tree.leaves(state.params))
    saved = _host(engine.gather_params(state))
    saved_opt = _host(state.opt_state)
    assert ckpt.save(state, engine=engine)
    ckpt.wait()

    # (data 8): no model axis; every leaf whole over the model.
    engine = _engine(second, model=1)
    assert MODEL not in engine.mesh.axis_names
    state = _restore(ckpt, engine, saved, saved_opt, step=2)
    assert not any(MODEL in _axes(x) for x in jax.tree.leaves(state))
    if second >= 1:
      assert any(DATA in _axes(x) for x in jax.tree.leaves(state.opt_state))
    state, more = m.run_steps(engine, state, BATCHES[2:3])
    losses += more
    saved = _host(engine.gather_params(state))
    saved_opt = _host(state.opt_state)
    assert ckpt.save(state, engine=engine)
    ckpt.wait()

    # (data 2, model 4): split over the model again, four ways now.
    engine = _engine(third, model=4)
    state = _restore(ckpt, engine, saved, saved_opt, step=3)
    assert any(x.sharding.shard_shape(x.shape) != x.shape and MODEL in
               _axes(x) for x in jax.tree.leaves(state.params))
    state, more = m.run_steps(engine, state, BATCHES[3:])
    losses += more
    assert ckpt.all_steps() == [2, 3]
  m.assert_matches(losses, engine.gather_params(state), ref_losses,
                   ref_params)
