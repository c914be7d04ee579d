"""ZeroConfig(remat="auto"): the fastest policy whose compiled step fits,
chosen by compiling (for an H100, no GPU needed)."""


import jax
import jax.numpy as jnp
import optax
from flax import nnx

import zero_jax as zj
from tests._gpu import compiles_for_gpus
from zero_jax import aot
from zero_jax.models import GPT, GPTConfig, make_loss_fn

pytestmark = compiles_for_gpus


def _engine(budget=None):
  cfg = GPTConfig(vocab_size=512, seq_len=256, d_model=128, n_layers=2,
                  n_heads=4)
  graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  engine = zj.Engine(make_loss_fn(graphdef), optax.adamw(1e-3),
                     zj.ZeroConfig(stage=3, compute_dtype="bfloat16",
                                   remat="auto", device_memory_bytes=budget),
                     aot.gpu_mesh("h100", 1))
  batch = {"tokens": jax.ShapeDtypeStruct((16, 257), jnp.int32)}
  c = aot.compile_step(engine, jax.eval_shape(lambda: params), batch)
  return engine, c.memory.peak


def test_auto_remat_keeps_the_fastest_policy_that_fits():
  # An H100's 79 GiB: nothing needs recomputing.
  engine, peak_none = _engine()
  assert engine.remat == "none"
  assert "remat auto chose none (fits 79.11 GiB" in engine.describe()
  # A budget below that peak: the next policy, which fits.
  engine, peak = _engine(budget=peak_none - 1)
  assert engine.remat == "dots_saveable" and peak < peak_none
  assert "compiled peaks: none 0.11 GiB, dots_saveable" in (
      engine.remat_reason)
  # Too little for any: the leanest, said so.
  engine, _ = _engine(budget=1)
  assert engine.remat == "full"
  assert "none fits" in engine.remat_reason
