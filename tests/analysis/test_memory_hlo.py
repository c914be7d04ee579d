"""Per-device memory and collectives, measured from the compiled step.

The steps (AdamW, 8 devices, the GPT of width 128: 4 layers, and 8 for the
growth test) are ``_shared.step``'s, which test_estimate.py measures too.
"""

import math

import pytest

from tests.analysis import _shared
from zero_jax import analysis
from zero_jax.analysis import (compiled_memory, estimate_activations,
                               paper_model_state_bytes, param_count,
                               per_device_bytes)

N = _shared.N


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_bytes_within_paper_formula(stage):
  _, params, batch = _shared.gpt()
  engine, state, compiled = _shared.step(stage)
  psi = param_count(params)
  mem = compiled_memory(compiled)
  state_bytes = mem.argument - per_device_bytes(engine.shard_batch(batch))
  # What the compiled step takes as its state is what the state holds.
  assert state_bytes == per_device_bytes(state)
  # fp32 training: 4-byte params and grads, K = 8 (AdamW's two moments).
  paper = paper_model_state_bytes(psi, N, stage, param_bytes=4, grad_bytes=4,
                                  k=8)
  assert state_bytes <= paper, (state_bytes, paper)
  # The state is donated: outputs reuse the inputs' buffers.
  assert mem.alias >= per_device_bytes(state.params)
  if stage == 3:
    # Master shard + two AdamW moment shards, plus the few small replicated
    # leaves (LayerNorm vectors, biases below min_shard_elements).
    replicated = engine.param_plan.replicated_elements
    assert state_bytes <= 12 * psi / N + 12 * replicated + 64


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradients_are_reduce_scattered_not_all_reduced(stage):
  # (The per-device step's own collectives, on any backend; a global
  # loss's are the compiler's, which on CPUs all-reduces and slices what it
  # reduce-scatters on GPUs: tests/analysis/test_gpu_compiled.py.)
  _, params, _ = _shared.gpt()
  engine, _, compiled = _shared.step(stage, loss_scope="per_device")
  psi = param_count(params)
  ops = analysis.summarize(compiled.as_text())
  all_reduce = ops.get("all-reduce", {}).get("elements", 0)
  if stage == 0:
    assert "reduce-scatter" not in ops
    assert all_reduce >= psi  # the whole gradient is all-reduced
    return
  rep = engine.param_plan.replicated_elements
  sharded = psi - rep
  # Every sharded gradient is reduce-scattered: the results are the shards.
  assert ops["reduce-scatter"]["elements"] == sharded // N
  # Only the small replicated leaves' gradients (and the loss) are
  # all-reduced: nothing of the size of the model.
  assert all_reduce <= rep + 16, (all_reduce, rep)
  assert rep < 0.05 * psi
  # Parameters are all-gathered once after the update (stages 1-2); at
  # stage 3 where they are used, and the scanned layers' again in backward
  # (remat), so between once and twice.
  if stage in (1, 2):
    assert ops["all-gather"]["elements"] == sharded
  else:
    # Every sharded layer leaf scan_layers runs is gathered twice (forward,
    # and the remat'd backward); leaves used outside the scan (embeddings,
    # head) once, their gathered value kept for backward like any other
    # forward value outside a remat'd region: at most 2Ψ, as in the paper.
    in_scan = sum(math.prod(lp.shape) for path, lp in engine.param_plan.rows()
                  if lp.sharded and path.startswith("blocks/"))
    assert 2 * in_scan <= ops["all-gather"]["elements"] <= 2 * sharded


def _measure(stage, n_layers, loss_scope="global"):
  _, params, _ = _shared.gpt(n_layers)
  return param_count(params), compiled_memory(
      _shared.step(stage, n_layers, loss_scope=loss_scope)[2])


@pytest.mark.parametrize("n_layers", [4, 8])
def test_stage3_peak_within_state_plus_two_layers_plus_activations(n_layers):
  # The bound: 16 bytes/param over N (fp32 master + 2 AdamW moments +
  # the gradient shard), plus the working set of two layers (their full fp32
  # parameters and gradients), plus activations (the estimate for per-layer
  # remat: saved layer inputs, one layer's working set, logits).
  d, seq, batch = 128, 16, 16
  psi, mem = _measure(3, n_layers)
  layer = 12 * d * d + 13 * d
  acts = estimate_activations(layers=n_layers, hidden=d, seq_len=seq,
                              micro_batch=batch // N, heads=4, vocab=64,
                              bytes_per_element=4, remat="full")
  bound = 16 * psi / N + 2 * 8 * layer + acts
  assert mem.peak <= bound, (mem.peak, bound)


def test_stage3_peak_grows_only_by_the_added_layers_shards():
  # Same layer size, twice the layers: with per-layer gathering the peak
  # grows by the added layers' state shards (master + 2 AdamW moments) and
  # gradient shards (16 bytes/param / N), plus each added layer's saved
  # input activation; not by their full parameters.
  psi_l, mem_l = _measure(3, 4)
  psi_2l, mem_2l = _measure(3, 8)
  added = psi_2l - psi_l
  saved_acts = 4 * (16 // N) * 16 * 128 * 4   # 4 layers x (B/N, T, d) fp32
  growth = mem_2l.peak - mem_l.peak
  assert growth <= 16 * added / N + saved_acts + 64 * 1024, (growth, added)
  # Whole-model gathering would have grown it by at least the added full
  # fp32 parameters.
  assert growth < 4 * added


def test_stage2_temp_saves_most_of_a_gradient_copy():
  # The per-device stage 1 holds each device's whole fp32 gradient until
  # backward ends; its stage 2 reduces each layer's as backward makes it.
  # With a global loss the compiler sums each layer's gradient into the
  # update's layout in the layer's own iteration, at stage 1 too.
  psi, mem1 = _measure(1, 4, "per_device")
  _, mem2 = _measure(2, 4, "per_device")
  _, glob1 = _measure(1, 4)
  _, glob2 = _measure(2, 4)
  print(f"\ntemp MiB, per-device stage 1 {mem1.temp / 2**20:.2f}, 2 "
        f"{mem2.temp / 2**20:.2f}; global 1 {glob1.temp / 2**20:.2f}, 2 "
        f"{glob2.temp / 2**20:.2f}; a fp32 gradient {4 * psi / 2**20:.2f}")
  assert mem1.temp - mem2.temp >= 0.7 * 4 * psi, (mem1.temp, mem2.temp, psi)
  # (On CPUs each layer's gradient is all-reduced, then sliced: 0.72x.)
  for glob in (glob1, glob2):
    assert mem1.temp - glob.temp >= 0.6 * 4 * psi, (mem1.temp, glob.temp)
