"""ZeRO++'s quantized collectives, compiled for 8 H100s: what crosses.

qwZ's parameter all-gathers move int8 blocks and their float32 scales,
about half a bf16 gather's bytes; qgZ's gradients cross as int8 blocks by
an all-to-all, about a quarter of a float32 reduce-scatter's. (A
CPU-compiled step would show neither: it upcasts narrow collectives.)
"""

import functools
import math

import jax
import jax.numpy as jnp
import optax

import zero_jax as zj
from tests._gpu import compiles_for_gpus
from zero_jax import analysis
from zero_jax.models import make_loss_fn

pytestmark = compiles_for_gpus

N = 8
_SHAPE = dict(layers=4, hidden=256, heads=4, vocab=256, seq_len=16)


@functools.cache
def _compiled(**overrides):
  mesh = analysis.gpu_mesh("h100", N)
  graphdef, params = analysis.gpt_shapes(**_SHAPE)
  engine = zj.Engine(make_loss_fn(graphdef), optax.adamw(1e-4),
                     zj.ZeroConfig(stage=3, compute_dtype="bfloat16",
                                   **{"prefetch": False, **overrides}), mesh)
  batch = {"tokens": jax.ShapeDtypeStruct((2 * N, _SHAPE["seq_len"] + 1),
                                          jnp.int32)}
  return engine, analysis.compile_step(engine, params, batch)


def _bytes(c, kind):
  return sum(d["bytes"] for (k, _), d in c.collectives.items() if k == kind)


def _sharded_elements(engine):
  return sum(math.prod(lp.shape) for _, lp in engine.param_plan.rows()
             if lp.sharded)


def test_qwz_gathers_int8_blocks_for_about_half_the_bf16_bytes():
  _, plain = _compiled()
  _, q = _compiled(quantized_weights=True)
  dtypes = {dt for kind, dt in q.collectives if kind == "all-gather"}
  assert dtypes == {"s8", "f32"}, dtypes
  # The same elements cross, int8 instead of bf16, plus a float32 scale
  # per block of 256.
  assert q.collectives[("all-gather", "s8")]["elements"] == (
      plain.collectives[("all-gather", "bf16")]["elements"])
  ratio = _bytes(q, "all-gather") / _bytes(plain, "all-gather")
  assert 0.5 < ratio <= 0.55, ratio


def test_qgz_sends_int8_gradient_blocks_for_a_quarter_of_fp32_bytes():
  engine, q = _compiled(quantized_gradients=True)
  kinds = {(kind, dt) for kind, dt in q.collectives if kind in (
      "all-to-all", "reduce-scatter")}
  assert kinds == {("all-to-all", "s8"), ("all-to-all", "f32")}, kinds
  # A float32 reduce-scatter of every sharded gradient moves 4 bytes an
  # element.
  fp32 = 4 * _sharded_elements(engine)
  assert q.collectives[("all-to-all", "s8")]["elements"] == (
      _sharded_elements(engine))
  ratio = _bytes(q, "all-to-all") / fp32
  assert 0.25 < ratio <= 0.3, ratio
