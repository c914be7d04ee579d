"""compute_dtype: bf16 forward/backward and communication, fp32 master."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zero_jax as zj
from tests import _models as m
from tests.train import _shared
from zero_jax import analysis
from zero_jax.layout._plan import flat

BF16 = jnp.bfloat16


def _cast(tree, dtype):
  return jax.tree.map(lambda x: x.astype(dtype), tree)


# Steps per model: the MLP's 10 of tests/_models, the GPT's 3 (each of its
# steps on 8 devices costs about what the MLP's engine costs to compile).
STEPS = {"mlp": _shared.MODEL_STEPS, "gpt": _shared.GPT_STEPS}


def _setup(model):
  """The model with ``STEPS[model]`` steps of batches."""
  return _shared.setup(model, STEPS[model])


def _global_rel_err(a, b) -> float:
  # Over the whole model: zero-initialised biases make per-leaf errors
  # meaningless in bf16 (Adam's first step is +-lr, so a gradient element
  # that rounds to the other sign flips the whole update).
  flat = lambda t: np.concatenate([np.ravel(np.asarray(x, np.float64))
                                   for x in jax.tree.leaves(t)])
  return float(np.linalg.norm(flat(a) - flat(b)) / np.linalg.norm(flat(b)))


@functools.cache
def _low_precision_reference(model, dtype):
  """Single-device training of the same fp32 master params, the forward and
  backward on their 16-bit cast: what mixed precision is supposed to be."""
  loss_fn, params, batches = _setup(model)
  tx = m.OPTIMIZERS["adamw"](m.LR_SCALE[model])
  return m.train_reference(lambda p, b: loss_fn(_cast(p, dtype), b), tx,
                           params, batches)


def _cases():
  # The grid (model, dtype) x stage runs pairwise by default: the GPT (in
  # bfloat16) and the MLP in float16 at every stage, the MLP in bfloat16
  # at one; its other stages are marked exhaustive.
  for model, dtype in [("mlp", "bfloat16"), ("gpt", "bfloat16"),
                       ("mlp", "float16")]:
    for stage in [0, 1, 2, 3]:
      default = (model, dtype) != ("mlp", "bfloat16") or stage == 2
      yield pytest.param(model, dtype, stage, marks=() if default else
                         pytest.mark.exhaustive)


@pytest.mark.parametrize("model,dtype,stage", list(_cases()))
def test_16bit_tracks_single_device_16bit(model, dtype, stage):
  # float16 runs with dynamic loss scaling from 2**16, and no step may
  # overflow; the reference scales nothing, so scaling is exact (powers of
  # two).
  ref_losses, ref_params = _low_precision_reference(model, dtype)
  loss_fn, params, batches = _setup(model)
  engine = zj.Engine(loss_fn, m.OPTIMIZERS["adamw"](m.LR_SCALE[model]),
                     zj.ZeroConfig(stage=stage, min_shard_elements=0,
                                   compute_dtype=dtype),
                     zj.make_mesh(num_devices=8))
  losses, params_out, state = m.train_engine(engine, params, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=5e-3)
  assert _global_rel_err(params_out, ref_params) < 2e-2
  if dtype == "float16":
    assert int(state.loss_scale.skipped) == 0
    assert float(state.loss_scale.scale) == 2.0 ** 16
  else:  # only skip_nonfinite's count, with no scale
    assert float(state.loss_scale.scale) == 1.0
    assert int(state.loss_scale.skipped) == 0
  # fp32 master and optimizer state; the 16-bit copy only at stages 1-2.
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
  if stage in (1, 2):
    for x, lp in zip(jax.tree.leaves(state.params),
                     flat(engine.param_plan.leaves)):
      assert x.sharding.is_fully_replicated == (not lp.sharded)
  if stage in (1, 2):
    # (Stage 2 keeps it with the default global loss, whose gradients the
    # compiler reduce-scatters; the per-device step's stage 2 gathers the
    # master's shards in the 16-bit dtype in forward instead:
    # tests/train/test_stage2_gather.py.)
    for x in jax.tree.leaves(state.compute_params):
      assert x.dtype == dtype and x.sharding.is_fully_replicated
  else:
    assert state.compute_params is None


def _emitted_comm(stage, compute_dtype, reduce_dtype=None):
  """Collectives of the step as zero_jax emits it (before XLA passes).

  Without prefetch, whose loop bodies (counted once here) gather and
  reduce one layer more than they run; its collectives are counted in
  tests/layers/test_prefetch.py."""
  loss_fn, params, batch = _gpt64()
  # (The per-device step's own collectives, emitted by zero_jax: the global
  # step's are the compiler's, tests/train/test_loss_scope.py's.)
  engine = zj.Engine(loss_fn, m.OPTIMIZERS["adamw"](),
                     zj.ZeroConfig(stage=stage, compute_dtype=compute_dtype,
                                   reduce_dtype=reduce_dtype, prefetch=False,
                                   loss_scope="per_device"),
                     zj.make_mesh(num_devices=8))
  # (Lowered from the state's shapes and shardings: nothing to compile.)
  state = engine.abstract_state(params)
  with jax.set_mesh(engine.mesh):
    lowered = engine.step.lower(state, batch)
  return analysis.summarize(lowered.as_text(dialect="hlo"))


@functools.cache
def _gpt64():
  loss_fn, params, batches = m.gpt_setup(d_model=64, n_layers=2, steps=1)
  return loss_fn, params, batches[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_halves_gathered_bytes(stage):
  # Measured on the HLO zero_jax emits: XLA's CPU backend later upcasts
  # 16-bit collectives to f32, so the compiled CPU program would show no
  # difference (GPU backends keep them in bf16).
  f32 = _emitted_comm(stage, None)
  bf16 = _emitted_comm(stage, "bfloat16")
  assert bf16["all-gather"]["elements"] == f32["all-gather"]["elements"]
  assert bf16["all-gather"]["bytes"] * 2 == f32["all-gather"]["bytes"]
  # Gradients are summed in fp32 by default, but cross in bf16: an
  # all-to-all hands each device every device's blocks of its shard, which
  # it sums in fp32 (a reduce-scatter's result is the fp32 shard, the
  # all-to-all's operand the whole bf16 gradient)...
  assert "reduce-scatter" not in bf16
  assert (bf16["all-to-all"]["bytes"] * 2 ==
          f32["reduce-scatter"]["bytes"] * 8)
  # ...and by a bf16 reduce-scatter when asked to sum in bf16.
  low = _emitted_comm(stage, "bfloat16", "bfloat16")
  assert "all-to-all" not in low
  assert low["reduce-scatter"]["bytes"] * 2 == f32["reduce-scatter"]["bytes"]


def test_compute_dtype_validation():
  with pytest.raises(ValueError, match=r"compute_dtype\) must be None or one"):
    zj.ZeroConfig(compute_dtype="int8")
  assert zj.ZeroConfig(compute_dtype=BF16).compute_dtype == "bfloat16"
