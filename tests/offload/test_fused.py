"""The fused host optimizer (update_on="host" with zero_jax.offload's
optimizers): its casts bit for bit, its updates against optax, its host
buffers through checkpoints, and the fallback it states."""

import ml_dtypes
import jax
import numpy as np
import optax
import pytest

import zero_jax as zj
from tests import _models as m
from zero_jax import offload
from zero_jax.offload import _kernels

STEPS = 4
CLIP = 0.5


def _optimizers():
  decay_matrices = lambda p: jax.tree.map(lambda x: len(x.shape) > 1, p)
  inject = optax.inject_hyperparams
  # name -> (the fused optimizer, the same built by optax alone: the fused
  # ones are optax's under inject_hyperparams, whose hyperparameters are
  # float32 arrays, not Python floats, so the arithmetic differs in the
  # last bit otherwise)
  return {
      "adamw": (lambda: offload.adamw(1e-2, weight_decay=0.1,
                                      mask=decay_matrices),
                lambda: inject(optax.adamw, static_args="mask")(
                    1e-2, weight_decay=0.1, mask=decay_matrices)),
      "adam": (lambda: offload.adam(optax.linear_schedule(1e-2, 1e-3, 3)),
               lambda: inject(optax.adam)(
                   optax.linear_schedule(1e-2, 1e-3, 3))),
      "lion": (lambda: offload.lion(1e-3), lambda: inject(optax.lion)(1e-3)),
      "sgd_nesterov": (lambda: offload.sgd(1e-2, momentum=0.9, nesterov=True),
                       lambda: inject(optax.sgd)(1e-2, momentum=0.9,
                                                 nesterov=True)),
      "sgd": (lambda: offload.sgd(1e-2), lambda: inject(optax.sgd)(1e-2)),
      "adagrad": (lambda: offload.adagrad(1e-2),
                  lambda: inject(optax.adagrad)(1e-2)),
  }


def test_casts_and_widening_are_bit_exact():
  k = _kernels.kernels()
  bits = np.random.default_rng(0).integers(0, 2**32, 200_000, np.uint32)
  edges = np.array([0, -0.0, 1, 65504, 65519.9, 65520, 6.1e-5, 5.96e-8,
                    2.98e-8, 2.99e-8, 1e-9, np.inf, -np.inf, np.nan],
                   np.float32)
  x = np.concatenate([bits.view(np.float32), edges])
  for dtype in (np.float16, ml_dtypes.bfloat16):
    out = np.empty(x.size, dtype)
    k.cast(x, _kernels.as_kernel_array(out))
    with np.errstate(all="ignore"):
      want = x.astype(dtype)
    np.testing.assert_array_equal(out.view(np.uint16), want.view(np.uint16))
    finite = want[np.isfinite(want.astype(np.float32))]
    assert k.sumsq(_kernels.as_kernel_array(finite)) == pytest.approx(
        np.sum(finite.astype(np.float64) ** 2), rel=1e-12)
  assert not np.isfinite(k.sumsq(_kernels.as_kernel_array(
      np.array([1, np.nan], ml_dtypes.bfloat16))))


def _engine(tx, stage, dtype="float32", accum=None):
  return zj.Engine(m.mlp_loss, tx, zj.ZeroConfig(
      stage=stage, offload_optimizer="host", update_on="host",
      clip_grad_norm=CLIP, compute_dtype=dtype, grad_accum_steps=accum,
      min_shard_elements=0), zj.make_mesh(num_devices=8))


# (optimizer, stage, compute dtype, micro-batches): every optimizer, every
# stage, each compute dtype, with and without accumulation. fp32 against
# single-device optax; 16-bit against the same engine with optax's own
# optimizer, whose update is the XLA:CPU program (the device's part, and so
# the gradients, are the same program).
CASES = [("adamw", 3, "float32", None), ("adagrad", 2, "float32", 2),
         ("adam", 0, "bfloat16", 2), ("lion", 1, "float16", None),
         ("sgd_nesterov", 2, "bfloat16", None), ("sgd", 3, "float16", 2),
         ("adamw", 1, "float16", 2), ("lion", 3, "bfloat16", 2)]


@pytest.mark.parametrize("name,stage,dtype,accum", CASES)
def test_fused_update_equals_optax(name, stage, dtype, accum):
  fused, plain = _optimizers()[name]
  params, batches = m.mlp_params(), m.mlp_batches(STEPS)
  engine = _engine(fused(), stage, dtype, accum)
  losses, out, state = m.train_engine(engine, params, batches)
  assert "fused host optimizer" in engine.describe()
  assert isinstance(jax.tree.leaves(state.params)[0], np.ndarray)
  if dtype == "float32":
    tx = optax.chain(optax.clip_by_global_norm(CLIP), plain())
    ref_losses, ref = m.train_reference(m.mlp_loss, tx, params, batches)
    tol = 1e-6
  else:
    xla = _engine(plain(), stage, dtype, accum)
    ref_losses, ref, _ = m.train_engine(xla, params, batches)
    assert "XLA:CPU program" in xla.describe()
    tol = 1e-6
  m.assert_matches(losses, out, ref_losses, ref, tol=tol)
  if dtype == "float16":
    assert float(state.loss_scale.scale) == 2.0 ** 16  # (scaled, no skip)


def test_fused_state_checkpoints_and_old_states_are_refused(tmp_path):
  fused, _ = _optimizers()["adamw"]
  params, batches = m.mlp_params(), m.mlp_batches(STEPS)
  engine = _engine(fused(), 3, "bfloat16")
  state, _ = m.run_steps(engine, engine.init(params), batches[:2])
  with zj.Checkpointer(tmp_path / "ckpt") as ckpt:
    ckpt.save(state)
  old = state
  state, losses = m.run_steps(engine, state, batches[2:])
  with pytest.raises(ValueError, match="updated in place"):
    engine.step(old, batches[0])
  # Restored into the fused engine, and into the XLA:CPU program's (optax's
  # own adamw under inject_hyperparams: the same state tree).
  with zj.Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt:
    again = ckpt.restore(engine, params)
    assert isinstance(jax.tree.leaves(again.params)[0], np.ndarray)
    xla = _engine(_optimizers()["adamw"][1](), 3, "bfloat16")
    other = ckpt.restore(xla, params)
  again, again_losses = m.run_steps(engine, again, batches[2:])
  other, other_losses = m.run_steps(xla, other, batches[2:])
  np.testing.assert_allclose(again_losses, losses, rtol=1e-6)
  np.testing.assert_allclose(other_losses, losses, rtol=1e-6)
  assert m.rel_err(engine.gather_params(again),
                   engine.gather_params(state)) == 0
  assert m.rel_err(xla.gather_params(other),
                   engine.gather_params(state)) < 1e-6


def test_bad_mask_names_the_fix():
  with pytest.raises(ValueError, match="tree of Python bools"):
    _engine(offload.adamw(1e-2, mask=lambda p: 1.0), 3).init(
        m.mlp_params())
