"""The remat policies between "full" and "none", and ZeroConfig(remat="auto"),
the fastest policy whose compiled step fits, chosen by compiling (for an
H100, no GPU needed); and the default GPT's attention there, cuDNN's, which
the attention policies keep.

Each policy's step is compiled once in this file: the candidates by the
engine itself as remat="auto" tries them (a spy keeps what it compiled),
dots_saveable (no candidate) by ``compile_step``. Programs compiled for GPUs
cannot be read back from the persistent compilation cache, so each compile
costs its full time every run.
"""

import collections
import functools
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import zero_jax as zj
from tests._gpu import compiles_for_gpus
from zero_jax import analysis
from zero_jax.config._remat import AUTO_CANDIDATES
from zero_jax.models import GPT, GPTConfig, make_loss_fn
from zero_jax.train import _auto_remat

pytestmark = compiles_for_gpus

_FORWARD = re.compile(r'custom_call_target="__cudnn\$fmhaSoftmax"')
_BACKWARD = re.compile(r'custom_call_target="__cudnn\$fmhaSoftmaxBackward"')
_BATCH = {"tokens": jax.ShapeDtypeStruct((16, 257), jnp.int32)}


def _engine(remat, budget=None, attention="auto"):
  """An engine for a 2-layer GPT on one compile-only H100, and the GPT's
  parameter shapes."""
  cfg = GPTConfig(vocab_size=512, seq_len=256, d_model=128, n_layers=2,
                  n_heads=4, attention=attention)
  graphdef, params = nnx.split(
      nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  engine = zj.Engine(make_loss_fn(graphdef), optax.adamw(1e-3),
                     zj.ZeroConfig(stage=3, compute_dtype="bfloat16",
                                   remat=remat, device_memory_bytes=budget),
                     analysis.gpu_mesh("h100", 1))
  return engine, params


def _choose(budget):
  """An auto engine after it chose its policy (compiling candidates)."""
  engine, params = _engine("auto", budget)
  engine.choose_remat(engine.abstract_state(params),
                      analysis.abstract_batch(engine, _BATCH))
  return engine


@functools.cache
def _auto():
  """``(engines, steps)``: auto engines by budget (None: the H100's own,
  else just below each candidate's compiled peak, and 1 byte), and each
  candidate's step as the engine compiled it, ``{policy: (peak, hlo)}``.

  With a budget of 1 byte nothing fits, so that engine compiles every
  candidate; the other engines find them in the engine's cache of compiled
  peaks (this file's own, swapped in, so each is compiled here once).
  """
  real = _auto_remat.compiled_memory
  compiled = []

  def spy(c):
    compiled.append(c)
    return real(c)

  engines = {}
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(_auto_remat, "_PEAKS", collections.OrderedDict())
    mp.setattr(_auto_remat, "compiled_memory", spy)
    engines[1] = _choose(1)
    assert len(compiled) == len(AUTO_CANDIDATES), compiled
    steps = {name: (real(c).peak, c.as_text())
             for name, c in zip(AUTO_CANDIDATES, compiled)}
    engines[None] = _choose(None)
    for name in AUTO_CANDIDATES[:2]:
      engines[name] = _choose(steps[name][0] - 1)
    # (Nothing compiled again.)
    assert len(compiled) == len(AUTO_CANDIDATES), compiled
  return engines, steps


def test_attention_policies_keep_cudnn_attention_for_backward():
  # The layer scan's forward body calls cuDNN's forward once; backward's
  # body calls its backward, and its forward again unless the policy keeps
  # the forward's outputs.
  _, steps = _auto()
  engine, params = _engine("dots_saveable")
  compiled = analysis.compile_step(engine, params, _BATCH)
  steps = {**steps, "dots_saveable": (compiled.memory.peak, compiled.hlo)}
  peaks = {}
  for remat, forwards in (("full", 2), ("attention_saveable", 1),
                          ("dots_saveable", 2),
                          ("dots_attention_saveable", 1), ("none", 1)):
    peak, hlo = steps[remat]
    assert len(_FORWARD.findall(hlo)) == forwards, remat
    assert len(_BACKWARD.findall(hlo)) == 1, remat
    peaks[remat] = peak
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
  engines, steps = _auto()
  # An H100's 79 GiB: nothing needs recomputing.
  engine = engines[None]
  assert engine.remat == "none"
  assert "remat auto chose none (fits 79.11 GiB" in engine.describe()
  peak_none = steps["none"][0]
  # Budgets just below each candidate's peak: the next one.
  engine = engines["none"]
  assert engine.remat == "dots_attention_saveable"
  assert steps["dots_attention_saveable"][0] < peak_none
  assert "compiled peaks: none 0.11 GiB, dots_attention_saveable" in (
      engine.remat_reason)
  engine = engines["dots_attention_saveable"]
  assert engine.remat == "attention_saveable"
  assert len(_FORWARD.findall(steps["attention_saveable"][1])) == 1
  # Too little for any: the leanest, said so.
  engine = engines[1]
  assert engine.remat == "full"
  assert "none fits" in engine.remat_reason


def test_default_gpt_calls_cudnn_attention_when_compiled_for_an_h100():
  # The GPT's default attention ("auto") is cuDNN's where the step is
  # compiled for an NVIDIA GPU, and its step peaks below the einsum's
  # (which holds the attention scores); full remat in both.
  assert GPTConfig().attention == "auto"
  _, steps = _auto()
  peak, hlo = steps["full"]
  engine, params = _engine("full", attention="einsum")
  einsum = analysis.compile_step(engine, params, _BATCH)
  assert "__cudnn$fmha" in hlo
  assert "__cudnn$fmha" not in einsum.hlo
  assert peak < einsum.memory.peak, (peak, einsum.memory.peak)
