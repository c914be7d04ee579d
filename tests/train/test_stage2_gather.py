"""Stage 2 gathering its parameters in forward (``prefetch``, the default
with ``loss_scope="per_device"``):
no 16-bit copy is kept between steps; forward gathers each layer of the
fp32 master's shards in the compute dtype (one layer ahead in
``scan_layers``) and keeps it for backward, as PyTorch FSDP's
SHARD_GRAD_OP does, where a replicated copy would be all-gathered after
each update with nothing to overlap.

It must train bit for bit as the replicated copy does, on every path a
model can take (a prefetched scan, a scan under another remat policy, whole
leaves), and be refused or left off where it cannot be honoured. Compiled
for 8 H100s, its gathers overlap gemms and its peak is no higher.
"""

import functools

import jax
import numpy as np
import optax
import pytest

import zero_jax as zj
from tests import _models as m
from tests._gpu import compiles_for_gpus
from tests.train import _shared
from zero_jax import analysis, layout, models

# (The per-device step's: with a loss of global meaning stage 2 keeps its
# replicated copy, and describe() says so: test_loss_scope.py.)
BF16 = {"stage": 2, "compute_dtype": "bfloat16", "loss_scope": "per_device"}


def _engine(loss_fn, model="gpt", replica=1, **kw):
  return zj.Engine(loss_fn, m.OPTIMIZERS["adamw"](m.LR_SCALE[model]),
                   zj.ZeroConfig(**{**BF16, **kw}),
                   zj.make_mesh(num_devices=8, replica=replica))


@functools.cache
def _trained(model, replica, kw):
  """(losses, params, state) of ``model`` trained with ``BF16`` and the
  fields ``kw`` (a tuple of items): the replicated copy's runs
  (prefetch=False) are the same for two of the cases below."""
  # (The GPT for 3 steps: enough for Adam's moments to matter.)
  steps = _shared.GPT_STEPS if model == "gpt" else _shared.MODEL_STEPS
  loss_fn, params, batches = _shared.setup(model, steps)
  return m.train_engine(_engine(loss_fn, model, replica, **dict(kw)),
                        params, batches)


@pytest.mark.parametrize("model,replica,kw", [
    ("gpt", 1, {}),                             # prefetched scan
    ("gpt", 2, {}),                             # ... with replica groups
    ("gpt", 1, {"remat": "dots_saveable"}),     # a plain scan keeps them
    ("gpt", 1, {"prefetch": True}),             # asked for
    ("mlp", 1, {"min_shard_elements": 0}),      # whole leaves, no scan
])
def test_gathering_in_forward_trains_as_the_replicated_copy(model, replica,
                                                           kw):
  (l0, p0, s0), (l1, p1, s1) = [
      _trained(model, replica, tuple(sorted({**kw, **off}.items())))
      for off in ({"prefetch": False}, {})]
  np.testing.assert_array_equal(l0, l1)
  for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Between steps: the sharded master alone, no replicated copy.
  assert all(c.sharding.is_fully_replicated
             for c in jax.tree.leaves(s0.compute_params))
  assert s1.compute_params is None
  for x0, x1 in zip(jax.tree.leaves(s0.params), jax.tree.leaves(s1.params)):
    assert x0.sharding == x1.sharding


def test_with_tensor_parallelism_too():
  # Each model rank gathers its own slice of the copy over data.
  from tests import _tp_models as tpm  # pylint: disable=g-import-not-at-top
  batches = tpm.tp_batches(3)
  runs = []
  for off in ({"prefetch": False}, {}):
    engine = zj.Engine(tpm.nnx_loss, optax.adamw(1e-2, weight_decay=0.1),
                       zj.ZeroConfig(**BF16, min_shard_elements=0, **off),
                       zj.make_mesh(model=2))
    runs.append(m.train_engine(engine, tpm.nnx_init(), batches))
  (l0, p0, _), (l1, p1, s1) = runs
  assert engine.placement.keeps_gathered
  np.testing.assert_array_equal(l0, l1)
  for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_layout_and_describe_say_so():
  loss_fn, params, _ = m.MODELS["gpt"](steps=1)
  on, off = _engine(loss_fn), _engine(loss_fn, prefetch=False)
  assert on.placement.keeps_gathered and not off.placement.keeps_gathered
  assert on.placement.compute_copy is None
  assert off.placement.compute_copy is layout.ComputeCopy.REPLICATED
  assert on.placement.materialize is layout.Materialize.GATHER
  assert off.placement.materialize is layout.Materialize.SCATTER
  on.init(params)
  text = on.describe()
  assert ("no bfloat16 copy between steps; forward gathers each layer of "
          "the master's shards in bfloat16 and keeps it for backward") in text
  assert ("prefetch (auto): each layer that zero_jax.layers.scan_layers "
          "runs is gathered while the one before it runs, and kept for "
          "backward") in text


def test_accumulation_keeps_the_replicated_copy_or_is_refused():
  # Each micro-batch's forward would gather the copy again: "auto" keeps
  # the all-gather after the update, once a step; True is refused.
  loss_fn, _, _ = m.MODELS["gpt"](steps=1)
  auto = _engine(loss_fn, grad_accum_steps=2)
  assert auto.placement.compute_copy is layout.ComputeCopy.REPLICATED
  with pytest.raises(ValueError, match="grad_accum_steps=2 micro-batches"):
    _engine(loss_fn, grad_accum_steps=2, prefetch=True)


@pytest.mark.parametrize("kw", [
    {"compute_dtype": None},
    {"offload_optimizer": "host"},
    {"offload_optimizer": "host", "update_on": "host"},
    {"remat": "dots_saveable"},
])
def test_what_stage_2_prefetch_cannot_honour_is_refused(kw):
  with pytest.raises(ValueError, match="ZeroConfig.prefetch gathers"):
    zj.ZeroConfig(**{**BF16, "prefetch": True, **kw})
  # ... and "auto" leaves the replicated copy there.
  config = zj.ZeroConfig(**{**BF16, **kw})
  assert not layout.decide_placement(config).keeps_gathered or (
      kw == {"remat": "dots_saveable"})


_TINY = dict(layers=12, hidden=128, heads=4, vocab=64, seq_len=16,
             micro_batch=2, attention="einsum")


@compiles_for_gpus
def test_its_gathers_overlap_gemms_and_its_peak_is_no_higher():
  # Compiled for 8 H100s: the replicated copy's all-gathers run after the
  # update, where no gemm is left to overlap; gathered one layer ahead in
  # forward, nine in ten overlap one, the same bf16 bytes once (backward
  # reads what forward kept: no second gather), and the peak is no higher
  # (experiments/stage3_bench.py: lower at 1.3B and 6.7B, N = 8 to 256).
  per_device = {"loss_scope": "per_device"}
  _, on = models.compile_gpt("h100", 8, 2, **_TINY, overrides=per_device)
  _, off = models.compile_gpt("h100", 8, 2, **_TINY,
                              overrides={**per_device, "prefetch": False})
  got = analysis.overlap_summary(on.hlo)["all-gather"]
  was = analysis.overlap_summary(off.hlo)["all-gather"]
  assert got.overlapped >= 0.9 * got.total, got
  assert was.overlapped == 0, was
  # (Prefetch's last forward iteration gathers the last layer twice.)
  assert was.bytes <= got.bytes <= was.bytes * (1 + 1.5 / _TINY["layers"])
  assert on.memory.peak <= off.memory.peak, (on.memory, off.memory)
