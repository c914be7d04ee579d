"""The remat policies between "full" and "none", and ZeroConfig(remat="auto"),
the fastest policy whose compiled step fits, chosen by compiling (for an
H100, no GPU needed)."""

import re

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import zero_jax as zj
from tests._gpu import compiles_for_gpus
from zero_jax import analysis
from zero_jax.models import GPT, GPTConfig, make_loss_fn

pytestmark = compiles_for_gpus

_FORWARD = re.compile(r'custom_call_target="__cudnn\$fmhaSoftmax"')
_BACKWARD = re.compile(r'custom_call_target="__cudnn\$fmhaSoftmaxBackward"')


def _compile(remat, budget=None):
  cfg = GPTConfig(vocab_size=512, seq_len=256, d_model=128, n_layers=2,
                  n_heads=4)
  graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  engine = zj.Engine(make_loss_fn(graphdef), optax.adamw(1e-3),
                     zj.ZeroConfig(stage=3, compute_dtype="bfloat16",
                                   remat=remat, device_memory_bytes=budget),
                     analysis.gpu_mesh("h100", 1))
  batch = {"tokens": jax.ShapeDtypeStruct((16, 257), jnp.int32)}
  return engine, analysis.compile_step(engine, jax.eval_shape(lambda: params),
                                  batch)


def test_attention_policies_keep_cudnn_attention_for_backward():
  # The layer scan's forward body calls cuDNN's forward once; backward's
  # body calls its backward, and its forward again unless the policy keeps
  # the forward's outputs.
  peaks = {}
  for remat, forwards in (("full", 2), ("attention_saveable", 1),
                          ("dots_saveable", 2),
                          ("dots_attention_saveable", 1), ("none", 1)):
    compiled = _compile(remat)[1]
    assert len(_FORWARD.findall(compiled.hlo)) == forwards, remat
    assert len(_BACKWARD.findall(compiled.hlo)) == 1, remat
    peaks[remat] = compiled.memory.peak
  # Each keeps more than the one before it; attention's outputs are small
  # next to the matmuls' (here 2 layers x (16 x 256 x 128 bf16 + 16 x 4 x
  # 256 float32) = 1.06 MiB, where the layout rounds up).
  order = ["full", "attention_saveable", "dots_saveable",
           "dots_attention_saveable", "none"]
  assert [peaks[r] for r in order] == sorted(peaks.values()), peaks
  assert peaks["attention_saveable"] - peaks["full"] < 4 * 2**20, peaks
  assert (peaks["dots_attention_saveable"] - peaks["dots_saveable"]
          < 4 * 2**20), peaks


def test_auto_remat_keeps_the_fastest_policy_that_fits():
  # An H100's 79 GiB: nothing needs recomputing.
  engine, compiled = _compile("auto")
  assert engine.remat == "none"
  assert "remat auto chose none (fits 79.11 GiB" in engine.describe()
  peak_none = compiled.memory.peak
  # Budgets just below each candidate's peak: the next one.
  engine, compiled = _compile("auto", budget=peak_none - 1)
  assert engine.remat == "dots_attention_saveable"
  assert compiled.memory.peak < peak_none
  assert "compiled peaks: none 0.11 GiB, dots_attention_saveable" in (
      engine.remat_reason)
  engine, compiled = _compile("auto", budget=compiled.memory.peak - 1)
  assert engine.remat == "attention_saveable"
  assert len(_FORWARD.findall(compiled.hlo)) == 1
  # Too little for any: the leanest, said so.
  engine, _ = _compile("auto", budget=1)
  assert engine.remat == "full"
  assert "none fits" in engine.remat_reason
