"""The compiled stage-0 step does what plain data parallelism does, and a
small, fixed amount more (``experiments/cpu_overhead.py`` times them).

Checks on the compiled programs, not timings: the reference GPT's step as
the engine compiles it at stage 0, next to a plain ``jax.jit`` data-parallel
step of the same loss and optimizer (parameters replicated, the batch split
over ``data``, the gradient all-reduce left to the compiler). What each
check guards was once in the stage-0 step:

- skipping a non-finite step (``skip_nonfinite``, on by default) selected
  the whole new state against the old one; XLA:CPU then copied every
  optimizer-state leaf on every step (1.45x the bytes plain data
  parallelism accesses here; 1.6x its step time on the GPT of
  ``experiments/cpu_overhead.py``);
- the global gradient norm (a metric, the skip's flag, clipping) read the
  whole model on every device.
"""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import zero_jax as zj
from tests import _models as m
from tests._gpu import compiles_for_gpus
from zero_jax.models import compile_gpt
from zero_jax.layout import DATA
from zero_jax.models import GPT, GPTConfig, make_loss_fn
from zero_jax.train import _update

# The tiny reference GPT: 2 scanned layers of width 64 (~130k parameters).
_GPT = GPTConfig(vocab_size=256, seq_len=16, d_model=64, n_layers=2,
                 n_heads=4)
_BATCH = {"tokens": np.zeros((8, _GPT.seq_len + 1), np.int32)}


def _tx():
  return optax.adamw(1e-3)


@functools.cache
def _gpt():
  graphdef, params = nnx.split(GPT(_GPT, rngs=nnx.Rngs(0)), nnx.Param)
  return graphdef, jax.tree.map(np.asarray, params)


@functools.cache
def _plain_dp():
  """The compiled plain data-parallel step."""
  graphdef, params = _gpt()
  mesh = zj.make_mesh()
  loss_fn, tx = make_loss_fn(graphdef), _tx()
  rep = NamedSharding(mesh, P())
  param_sh = jax.tree.map(lambda _: rep, params)
  opt_sh = jax.tree.map(lambda _: rep, jax.eval_shape(tx.init, params))

  def step(state, batch):
    p, o = state
    loss, g = jax.value_and_grad(loss_fn)(p, batch)
    u, o = tx.update(g, o, p)
    return (optax.apply_updates(p, u), o), loss

  jitted = jax.jit(step, in_shardings=((param_sh, opt_sh),
                                       NamedSharding(mesh, P(DATA))),
                   out_shardings=((param_sh, opt_sh), rep),
                   donate_argnums=0)
  state = (params, jax.eval_shape(tx.init, params))
  with jax.set_mesh(mesh):
    return jitted.lower(state, _BATCH).compile()


@functools.cache
def _stage0(**config):
  graphdef, params = _gpt()
  engine = zj.Engine(make_loss_fn(graphdef), _tx(),
                     zj.ZeroConfig(stage=0, **config), zj.make_mesh())
  state = engine.abstract_state(params)
  with jax.set_mesh(engine.mesh):
    return engine.step.lower(state, _BATCH).compile()


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%\S+ = (.*)$")
_OPCODE = re.compile(r"(?:^|[\])}] )([a-z][a-z0-9-]*)\(")


def _count(compiled, opcode: str) -> int:
  """Instructions of ``opcode`` in the compiled HLO (loop bodies once)."""
  n = 0
  for line in compiled.as_text().splitlines():
    i = _INSTRUCTION.match(line)
    op = i and _OPCODE.search(i.group(1))
    n += bool(op and op.group(1) == opcode)
  return n


def _entry_parameter_copies(compiled) -> int:
  """Copies of the step's own arguments (the entry computation's
  parameters are ``%param.N``; a fused computation's ``%param_N.M``)."""
  return len(re.findall(r" copy\(%param\.\d+\)", compiled.as_text()))


def _cost(compiled, key: str) -> float:
  cost = compiled.cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)[key]


_SKIP = [pytest.param({}, id="skip_nonfinite"),
         pytest.param({"skip_nonfinite": False}, id="no_skip")]


@pytest.mark.parametrize("config", _SKIP)
def test_the_state_is_updated_in_place_without_copies(config):
  # Plain data parallelism copies none of its (donated) state either.
  assert _entry_parameter_copies(_plain_dp()) == 0
  assert _entry_parameter_copies(_stage0(**config)) == 0


@pytest.mark.parametrize("config", _SKIP)
def test_no_select_over_the_state(config):
  # (The loss's own selects: the causal mask, the cross-entropy.) A
  # select of the new state against the old would add one per leaf of
  # master and moments: 3 x 16 here.
  assert _count(_stage0(**config), "select") <= _count(_plain_dp(),
                                                       "select") + 2


def test_skipping_is_one_conditional_around_the_update_on_cpu():
  assert _count(_stage0(), "conditional") == 1
  assert _count(_stage0(skip_nonfinite=False), "conditional") == 0


def test_as_many_all_reduces_as_plain_data_parallelism():
  # The gradients' (with the loss) and the norm's partial sums (with the
  # small leaves' gradients): plain data parallelism's are the layers'
  # gradients in the backward loop and the rest after it. With a global
  # loss the compiler sums the norm's partial sums (with the loss and the
  # small leaves' gradients) in one all-reduce more: the gradients' it
  # reads come first.
  plain = _count(_plain_dp(), "all-reduce")
  assert _count(_stage0(loss_scope="per_device"), "all-reduce") <= plain
  assert _count(_stage0(), "all-reduce") <= plain + 1


def test_bytes_and_flops_within_a_few_percent_of_plain_data_parallelism():
  # (Cost analysis counts a loop body once: plain data parallelism's
  # all-reduce of each layer's gradients inside the backward loop counts
  # for one layer, the engine's after it for all: about 4% here.) The
  # select of the whole state made the step read 1.45x the bytes; the norm
  # of the whole model on every device added 3% to the flops.
  dp, zero = _plain_dp(), _stage0()
  assert _cost(zero, "bytes accessed") <= 1.1 * _cost(dp, "bytes accessed")
  assert _cost(zero, "flops") <= 1.02 * _cost(dp, "flops")


def test_the_norm_is_read_a_slice_per_device_at_stage_0():
  engine = zj.Engine(m.mlp_loss, optax.adam(1e-2), zj.ZeroConfig(stage=0),
                     zj.make_mesh())
  engine.init(m.mlp_params())
  slices = dict(zip(engine.param_plan.leaves, _update.norm_slices(
      engine.layout)))
  # w1 (16, 64), w2 (64, 64): split on their largest divisible dimension;
  # b1 and w3 have fewer than min_shard_elements (1024) and stay whole.
  assert slices == {"w1": P(None, DATA), "w2": P(None, DATA), "b1": None,
                    "w3": None}
  # At stage 3 the plan splits them already: nothing more to slice.
  engine3 = zj.Engine(m.mlp_loss, optax.adam(1e-2), zj.ZeroConfig(stage=3),
                      zj.make_mesh())
  engine3.init(m.mlp_params())
  assert _update.norm_slices(engine3.layout) == [None] * 4


_CLIP = 0.05


@functools.cache
def _clipped_reference():
  """Single-device Adam clipped at ``_CLIP`` on the MLP for 4 steps: the
  global norm of each step's gradient, the final parameters."""
  tx = optax.chain(optax.clip_by_global_norm(_CLIP), optax.adam(1e-2))

  @jax.jit  # (one program, not one per operation)
  def step(params, opt_state, b):
    g = jax.grad(m.mlp_loss)(params, b)
    u, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, u), opt_state, optax.tree.norm(g)

  ref = jax.device_put(m.mlp_params(), jax.devices()[0])
  opt_state, norms = tx.init(ref), []
  for b in m.mlp_batches(steps=4):
    ref, opt_state, norm = step(ref, opt_state, b)
    norms.append(float(norm))
  return norms, ref


@pytest.mark.parametrize("replica", [1, 2])
def test_the_sliced_norm_and_clipping_are_exact(replica):
  params, batches = m.mlp_params(), m.mlp_batches(steps=4)
  clip = _CLIP
  norms, ref = _clipped_reference()
  assert min(norms) > clip  # clipping is active
  engine = zj.Engine(m.mlp_loss, optax.adam(1e-2),
                     zj.ZeroConfig(stage=0, clip_grad_norm=clip),
                     zj.make_mesh(num_devices=8, replica=replica))
  state = engine.init(params)
  for b, norm in zip(batches, norms):
    state, metrics = engine.step(state, b)
    assert abs(float(metrics["grad_norm"]) - norm) <= 1e-6 * norm
  assert m.rel_err(engine.gather_params(state), ref) <= 1e-5


@compiles_for_gpus
def test_gpu_programs_skip_by_a_select_not_a_conditional():
  # A lax.cond keeps the old and the new state apart on the GPU (the 1.3B
  # GPT's H100 step: 37.0 GiB against 27.3): there the skip is a select
  # fused into each leaf's update.
  _, c = compile_gpt("h100", 8, 0, layers=2, hidden=64, heads=4, vocab=64,
                     seq_len=16, micro_batch=2, compute_dtype=None)
  assert "conditional(" not in c.hlo
  assert re.search(r" select\(", c.hlo)
