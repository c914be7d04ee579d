"""The analytic estimator: hand counts, the compiled step, and the CLI."""

import dataclasses
import decimal
import math
import os
import subprocess
import sys

import jax
import optax
import pytest

import zero_jax as zj
from tests import _models as m
from tests.analysis import _shared
from zero_jax import analysis
from zero_jax.analysis import (Estimate, comm_in_psi, compiled_memory,
                               estimate_activations, estimate_comm,
                               estimate_memory, main, paper_model_state_bytes,
                               param_count, per_device_bytes,
                               train_state_bytes)
from zero_jax.analysis._arguments import parse_count
from zero_jax.analysis._comm import comm_volume
from zero_jax.analysis._measure import bytes_by_memory_kind
from zero_jax.analysis._memory import paper_estimate

N = 8
GIB = 2 ** 30
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def _split(e: Estimate) -> tuple[float, float, float]:
  return e.params, e.grads, e.opt_state


# ------------------------------------------------------------ hand counts


@pytest.mark.parametrize("stage,expected", [
    (0, (4000, 4000, 8000)),   # everything replicated
    (1, (4000, 4000, 1000)),   # replicated fp32 params are the master
    (2, (4000, 500, 1000)),
    (3, (500, 500, 1000)),
])
def test_fp32_layouts_by_hand(stage, expected):
  e = estimate_memory(1000, 8, stage, optimizer="adamw")
  assert _split(e) == expected
  assert e.model_states == sum(expected)
  assert e.persistent == expected[0] + expected[2]


@pytest.mark.parametrize("stage,expected", [
    (0, (6400, 3200, 12800)),        # fp32 master; bf16 grads
    (1, (800 + 3200, 3200, 1600)),   # master shard + replicated bf16 copy
    (2, (800 + 3200, 400, 1600)),
    (3, (800, 800, 1600)),           # master shard; fp32 grad shards
])
def test_mixed_precision_layouts_by_hand(stage, expected):
  e = estimate_memory(1600, 8, stage, compute_dtype="bfloat16")
  assert _split(e) == expected
  # fp32 "compute" is fp32 training.
  assert (estimate_memory(1600, 8, stage, compute_dtype="float32") ==
          estimate_memory(1600, 8, stage))


def test_replica_groups_shard_over_devices_per_group():
  for stage in range(4):
    assert (estimate_memory(1600, 16, stage, replica=2) ==
            estimate_memory(1600, 8, stage))
  with pytest.raises(ValueError, match="not divisible by replica=3"):
    estimate_memory(1600, 16, 1, replica=3)


def test_optimizer_bytes_and_replicated_leaves():
  k = lambda **kw: estimate_memory(800, 8, 0, **kw).opt_state / 800
  assert (k(optimizer="sgd"), k(optimizer="sgd_momentum"),
          k(optimizer="lion"), k(optimizer="adafactor"), k(optimizer="adam"),
          k(optimizer="adam", k=6)) == (0, 4, 4, 0, 8, 6)
  with pytest.raises(ValueError, match="known: .*'adamw'"):
    estimate_memory(800, 8, 0, optimizer="adamx")
  # 200 replicated parameters stay whole on every device.
  e = estimate_memory(1000, 8, 3, replicated=200)
  assert _split(e) == (4 * 300, 4 * 300, 8 * 300)
  with pytest.raises(ValueError, match="stage must be"):
    estimate_memory(1000, 8, 4)
  # The dtype that is wrong is the one named.
  with pytest.raises(ValueError, match="reduce_dtype must be a float dtype "
                     "of at most 4 bytes, got 'int8'"):
    estimate_comm(1000, 8, 3, reduce_dtype="int8")
  with pytest.raises(ValueError, match="compute_dtype must be a float dtype "
                     "of at most 4 bytes, got 'float64'"):
    estimate_memory(1000, 8, 3, compute_dtype="float64")


def test_paper_estimate_is_the_paper_formula():
  psi, n = 7.5e9, 64
  for stage in range(4):
    assert paper_estimate(psi, n, stage).model_states == pytest.approx(
        paper_model_state_bytes(psi, n, stage))
  # The paper's headline: 7.5B parameters on 64 GPUs at P_os+g+p, 1.88 GB.
  assert paper_estimate(psi, n, 3).model_states == pytest.approx(1.875e9)
  # fp32 Adam: zero_jax's stage 3 layout is exactly the paper's.
  assert (estimate_memory(psi, n, 3).model_states == paper_estimate(
      psi, n, 3, param_bytes=4, grad_bytes=4, k=8).model_states)


# The ZeRO paper's Table 1 (arXiv:1910.02054): per-device GB (1e9 bytes) of
# mixed-precision Adam's model states, 2Ψ + 2Ψ + 12Ψ, by DP degree; columns
# P_os, P_os+g, P_os+g+p. As printed, to the paper's precision.
_TABLE_1 = {
    7.5e9: {1: ("120", "120", "120"), 4: ("52.5", "41.3", "30"),
            16: ("35.6", "21.6", "7.5"), 64: ("31.4", "16.6", "1.88"),
            256: ("30.4", "15.4", "0.47"), 1024: ("30.1", "15.1", "0.12")},
    128e9: {1: ("2048", "2048", "2048"), 4: ("896", "704", "512"),
            16: ("608", "368", "128"), 64: ("536", "284", "32"),
            256: ("518", "263", "8"), 1024: ("513", "257", "2")},
    1e12: {1: ("16000", "16000", "16000"), 4: ("7000", "5500", "4000"),
           16: ("4750", "2875", "1000"), 64: ("4187", "2218", "250"),
           256: ("4046", "2054", "62.5"), 1024: ("4011", "2013", "15.6")},
}


def _as_printed(gb: float, printed: str) -> set[str]:
  """``gb`` to the decimals of ``printed``, rounded half up and cut off: the
  paper rounds (41.25 -> 41.3) but cuts its integers (513.5 -> 513)."""
  places = len(printed.partition(".")[2])
  # (12 digits: the float's last bits are not the paper's.)
  value = decimal.Decimal(f"{gb:.12g}")
  quantum = decimal.Decimal(1).scaleb(-places)
  return {str(value.quantize(quantum, rounding=r))
          for r in (decimal.ROUND_HALF_UP, decimal.ROUND_FLOOR)}


@pytest.mark.parametrize("psi", sorted(_TABLE_1))
def test_paper_formula_reproduces_table_1(psi):
  for dp, row in _TABLE_1[psi].items():
    for stage, printed in zip((1, 2, 3), row):
      gb = paper_model_state_bytes(psi, dp, stage) / 1e9
      assert printed in _as_printed(gb, printed), (psi, dp, stage, gb)
      assert paper_estimate(psi, dp, stage).model_states / 1e9 == (
          pytest.approx(gb))
    # DP 1 is plain data parallelism, 16Ψ.
    if dp == 1:
      assert paper_model_state_bytes(psi, 1, 0) == 16 * psi
  # The check itself tells the printed figures apart.
  assert _as_printed(41.25, "41.3") == {"41.3", "41.2"}
  assert "41.3" not in _as_printed(41.45, "41.3")
  assert "52.5" not in _as_printed(41.25, "52.5")


def test_paper_example_with_model_parallelism():
  # 1T parameters on 1024 GPUs as MP 16 x DP 64: 16 TB / 1024 = 15.6 GB per
  # device at P_os+g+p.
  assert paper_model_state_bytes(1e12, 1, 0) == 16e12
  gb = paper_model_state_bytes(1e12, 64, 3, model_parallel=16) / 1e9
  assert gb == 16e12 / 1024 / 1e9 == 15.625
  assert "15.6" in _as_printed(gb, "15.6")
  assert paper_estimate(1e12, 64, 3, model_parallel=16).model_states == (
      15.625e9)
  # Model parallelism splits what plain DP would hold: Ψ/M on N.
  for stage in range(4):
    assert paper_model_state_bytes(1e12, 64, stage, model_parallel=16) == (
        paper_model_state_bytes(1e12 / 16, 64, stage))
    assert paper_estimate(1e12, 64, stage, model_parallel=16) == (
        paper_estimate(1e12 / 16, 64, stage))
  # zero_jax's stage 3 keeps 16 bytes per parameter too (fp32 Adam; or a
  # bf16 compute dtype: fp32 master and gradient shards), so its estimate on
  # the 1024 devices is the paper's.
  assert estimate_memory(1e12, 1024, 3, model_parallel=16).model_states == (
      15.625e9)
  assert estimate_memory(1e12, 1024, 3, model_parallel=16,
                         compute_dtype="bfloat16").model_states == 15.625e9
  with pytest.raises(ValueError, match="model_parallel must be an integer "
                     ">= 1, got 0; pass the model-parallel degree M"):
    paper_model_state_bytes(1e12, 64, 3, model_parallel=0)
  with pytest.raises(ValueError, match="model_parallel must be an integer"):
    paper_estimate(1e12, 64, 3, model_parallel=1.5)


@pytest.mark.parametrize("model_parallel", [2, 4, 8])
@pytest.mark.parametrize("options", [
    {}, {"compute_dtype": "bfloat16"}, {"replica": 2},
    {"compute_dtype": "bfloat16", "offload_optimizer": True},
    {"offload_params": True},
    {"update_on": "host", "offload_optimizer": True}])
def test_model_parallel_holds_one_mth_of_the_state(model_parallel, options):
  devices, mp = 64, model_parallel
  stages = (3,) if options.get("offload_params") else range(4)
  for stage in stages:
    with_mp = estimate_memory(7.5e9, devices, stage, model_parallel=mp,
                              **options)
    without = estimate_memory(7.5e9, devices // mp, stage, **options)
    # Exactly 1/M of the state of devices / M devices without it.
    assert with_mp == Estimate(**{
        f.name: getattr(without, f.name) / mp
        for f in dataclasses.fields(Estimate)}), (stage, options)
    assert with_mp.model_states > 0
  # model_parallel=1 is the default.
  assert estimate_memory(7.5e9, devices, 3, model_parallel=1, **options) == (
      estimate_memory(7.5e9, devices, 3, **options))


def test_model_parallel_of_three_and_what_it_leaves_alone():
  # M need not be a power of two: 1/3 up to rounding.
  for stage in range(4):
    with_mp = estimate_memory(1.3e9, 24, stage, model_parallel=3)
    without = estimate_memory(1.3e9, 8, stage)
    assert _split(with_mp) == pytest.approx(
        tuple(x / 3 for x in _split(without)), rel=1e-12)
  # Activations are a per-device figure, added as given.
  e = estimate_memory(1e9, 8, 3, model_parallel=2, activations=1e6)
  assert e.activations == 1e6 and e.total == e.model_states + 1e6
  # Replicated parameters count among one model rank's Ψ/M.
  e = estimate_memory(1000, 8, 3, model_parallel=2, replicated=100)
  assert _split(e) == (4 * 200, 4 * 200, 8 * 200)   # 400/4 + 100 each
  with pytest.raises(ValueError, match=r"replicated=600 exceeds the psi / "
                     r"model_parallel = 500.0 parameters of one model rank"):
    estimate_memory(1000, 8, 3, model_parallel=2, replicated=600)


@pytest.mark.parametrize("kwargs,message", [
    ({"model_parallel": 0}, "model_parallel must be an integer >= 1, got 0; "
     "pass the model-parallel degree M"),
    ({"model_parallel": 2.0}, "write 2, an int, not 2.0"),
    ({"model_parallel": True}, "True/False is not a number here"),
    ({"model_parallel": 3}, r"devices=8 is not divisible by replica=1 x "
     r"model_parallel=3 = 3: .* choose a model_parallel \(and replica\) "
     r"whose product divides devices"),
    ({"model_parallel": 4, "replica": 4}, "devices=8 is not divisible by "
     "replica=4 x model_parallel=4 = 16"),
    # The replica check comes first, as without model parallelism.
    ({"model_parallel": 2, "replica": 3}, "not divisible by replica=3:"),
])
def test_model_parallel_is_checked(kwargs, message):
  with pytest.raises(ValueError, match=message):
    estimate_memory(1e9, 8, 3, **kwargs)


def test_activations_by_hand():
  shape = dict(layers=3, hidden=8, seq_len=4, micro_batch=2, heads=2,
               vocab=10)
  per_layer = 4 * 2 * 8 * (34 + 5 * 2 * 4 / 8)   # Korthikanti, 16-bit
  logits = 2 * 2 * 4 * 10 * 2
  assert estimate_activations(**shape, remat="none") == 3 * per_layer + logits
  # Full remat: each layer's input plus one layer's working set.
  assert (estimate_activations(**shape, remat="full") ==
          3 * 4 * 2 * 8 * 2 + per_layer + logits)
  assert (estimate_activations(**shape, bytes_per_element=4, remat="none") ==
          2 * (3 * per_layer + logits))
  with pytest.raises(ValueError, match="remat"):
    estimate_activations(**shape, remat="dots")
  e = estimate_memory(1000, 8, 3, activations=1e6)
  assert e.total == e.model_states + 1e6


def test_communication_by_hand():
  psi = 1000
  ar = estimate_comm(psi, 8, 0)
  assert ar == {"all-reduce": {"elements": 1000, "bytes": 4000}}
  assert comm_volume({k: v["elements"] for k, v in ar.items()}) == 2 * psi
  for stage, volume in ((1, 2), (2, 2), (3, 3)):
    c = estimate_comm(psi, 8, stage)
    assert set(c) == {"reduce-scatter", "all-gather"}
    assert comm_volume({k: v["elements"] for k, v in c.items()}) == (
        volume * psi)
  # Parameters are gathered in the compute dtype; gradients are summed in
  # fp32 unless a reduce dtype says otherwise (as ZeroConfig), and 16-bit
  # gradients summed in fp32 cross in 16 bits, by an all-to-all.
  bf16 = estimate_comm(psi, 8, 3, compute_dtype="bfloat16")
  assert bf16["all-gather"] == {"elements": 2000, "bytes": 4000}
  assert bf16["all-to-all"] == {"elements": 1000, "bytes": 2000}
  assert "reduce-scatter" not in bf16
  assert comm_volume({k: v["elements"] for k, v in bf16.items()}) == 3 * psi
  assert estimate_comm(psi, 8, 3, reduce_dtype="bfloat16")[
      "reduce-scatter"]["bytes"] == 2000
  assert estimate_comm(psi, 8, 3, compute_dtype="bfloat16",
                       reduce_dtype="bfloat16")["reduce-scatter"] == {
                           "elements": 1000, "bytes": 2000}
  # Replicated leaves are all-reduced instead; replica groups all-reduce
  # each gradient shard (Ψ/N) on top.
  c = estimate_comm(psi, 16, 2, replica=2, replicated=200)
  assert c["reduce-scatter"]["elements"] == 800
  assert c["all-reduce"]["elements"] == 200 + 800 / 8


def test_comm_in_psi_counts_reduce_scatter_by_its_input():
  summary = {"reduce-scatter": {"count": 2, "elements": 125, "bytes": 500},
             "all-gather": {"count": 2, "elements": 1000, "bytes": 4000},
             "all-reduce": {"count": 1, "elements": 10, "bytes": 40}}
  assert comm_in_psi(summary, 1000, 8) == {
      "reduce-scatter": 1.0, "all-gather": 1.0, "all-reduce": 0.01}


# -------------------------------------- against the compiled reference GPT


@pytest.fixture(scope="module")
def gpt():
  """``(params, batch, compiled)``: ``compiled(stage, replica=1,
  compute_dtype=None)`` is ``_shared.step``'s (engine, state, compiled
  step), AdamW on 8 devices (test_memory_hlo.py measures the same steps)."""
  _, params, batch = _shared.gpt()

  def compiled(stage, replica=1, compute_dtype=None):
    # (The per-device step's own collectives, which estimate_comm counts:
    # on CPU the global step's compiler all-reduces gradients.)
    return _shared.step(stage, replica=replica, compute_dtype=compute_dtype,
                        loss_scope="per_device")

  return params, batch, compiled


def _measured(engine, state, compiled, batch):
  split = train_state_bytes(state)
  state_bytes = (compiled_memory(compiled).argument -
                 per_device_bytes(engine.shard_batch(batch)))
  # The per-field split accounts for every byte the step takes as state.
  assert sum(split.values()) == state_bytes
  # Every parameter copy (a compute-dtype copy too, once TrainState has one).
  params = sum(v for k, v in split.items() if "params" in k)
  return split, params, state_bytes


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_states_agree_with_the_compiled_step(gpt, stage):
  params, batch, compiled = gpt
  engine, state, c = compiled(stage)
  psi = param_count(params)
  split, measured_params, state_bytes = _measured(engine, state, c, batch)
  # The ideal layout (every leaf sharded) is within 10% of the engine's ...
  est = estimate_memory(psi, N, stage, optimizer="adamw")
  assert measured_params == pytest.approx(est.params, rel=0.10)
  assert split["opt_state"] == pytest.approx(est.opt_state, rel=0.10)
  assert state_bytes == pytest.approx(est.persistent, rel=0.10)
  # ... and counting the replicated leaves makes it exact, up to scalars
  # (step, rng key, Adam's step count).
  exact = estimate_memory(psi, N, stage,
                          replicated=engine.param_plan.replicated_elements)
  assert measured_params == exact.params
  assert 0 <= split["opt_state"] - exact.opt_state <= 8
  assert 0 <= state_bytes - exact.persistent <= 32


def test_split_of_abstract_state(gpt):
  _, _, compiled = gpt
  engine, state, _ = compiled(3)
  abstract = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
      engine.state_shardings)
  assert train_state_bytes(abstract) == train_state_bytes(state)
  assert set(train_state_bytes(state)) == {
      f.name for f in dataclasses.fields(state)}
  with pytest.raises(TypeError, match="TrainState"):
    train_state_bytes({"params": 1})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_measured_communication_in_psi(gpt, stage):
  params, _, compiled = gpt
  engine, _, c = compiled(stage)
  psi = param_count(params)
  rep = engine.param_plan.replicated_elements
  measured = comm_in_psi(analysis.summarize(c.as_text()), psi, N)
  est = {k: v["elements"] / psi
         for k, v in estimate_comm(psi, N, stage, replicated=rep).items()}
  ideal = {k: v["elements"] / psi
           for k, v in estimate_comm(psi, N, stage).items()}
  assert set(measured) == set(est)
  for kind, x in measured.items():
    expected = est[kind]
    if stage == 3 and kind == "all-gather":
      # 2Ψ is a bound: backward re-gathers only the scanned layers' shards
      # (under remat); embeddings and head are gathered once.
      layers = sum(math.prod(lp.shape) for p, lp in engine.param_plan.rows()
                   if lp.sharded and p.startswith("blocks"))
      expected = (psi - rep + layers) / psi
      assert x <= est[kind]
    # Within 2% (plus the loss scalar all-reduced), and the ideal layout
    # within 2% plus the replicated leaves.
    assert x == pytest.approx(expected, rel=0.02, abs=2 / psi), kind
    assert abs(x - ideal.get(kind, 0)) <= (0.02 * ideal.get(kind, 0) +
                                           2 * rep / psi +
                                           abs(expected - est[kind])), kind


def test_bf16_with_replica_groups_agrees_with_the_compiled_step(gpt):
  # One compile covers both: stage 1 keeps a replicated bf16 copy next to
  # the fp32 master shard, and 2 replica groups shard over N = 4.
  params, batch, compiled = gpt
  engine, state, c = compiled(1, replica=2, compute_dtype="bfloat16")
  psi, n = param_count(params), N // 2
  split, measured_params, state_bytes = _measured(engine, state, c, batch)
  est = estimate_memory(psi, N, 1, compute_dtype="bfloat16", replica=2)
  assert measured_params == pytest.approx(est.params, rel=0.10)
  assert split["opt_state"] == pytest.approx(est.opt_state, rel=0.10)
  assert state_bytes == pytest.approx(est.persistent, rel=0.10)
  rep = engine.param_plan.replicated_elements
  exact = estimate_memory(psi, N, 1, compute_dtype="bfloat16", replica=2,
                          replicated=rep)
  assert measured_params == exact.params
  assert 0 <= state_bytes - exact.persistent <= 32
  # Gradient shards are all-reduced over the replica groups.
  measured = comm_in_psi(analysis.summarize(c.as_text()), psi, n)
  comm = estimate_comm(psi, N, 1, compute_dtype="bfloat16", replica=2,
                       replicated=rep)
  assert set(measured) == set(comm)
  for kind, d in comm.items():
    assert measured[kind] == pytest.approx(d["elements"] / psi, rel=0.02,
                                           abs=2 / psi), kind


@pytest.mark.parametrize("stage,compute_dtype,offload", [
    (0, None, "optimizer"), (1, "bfloat16", "optimizer"),
    (2, None, "optimizer"), (3, "bfloat16", "optimizer"),
    (3, None, "params"), (3, "bfloat16", "both")])
def test_offload_estimate_matches_where_the_state_lives(stage, compute_dtype,
                                                        offload):
  # No compile needed: the state's leaves carry their memory kinds.
  loss_fn, params, _ = m.gpt_setup(d_model=64, n_layers=2, steps=1)
  config = zj.ZeroConfig(
      stage=stage, compute_dtype=compute_dtype,
      offload_optimizer="host" if offload != "params" else None,
      offload_params="host" if offload != "optimizer" else None)
  engine = zj.Engine(loss_fn, optax.adamw(1e-3), config,
                     zj.make_mesh(num_devices=N))
  state = engine.init(params)
  measured = bytes_by_memory_kind(state)
  est = estimate_memory(param_count(params), N, stage,
                        compute_dtype=compute_dtype,
                        replicated=engine.param_plan.replicated_elements,
                        offload_optimizer=offload != "params",
                        offload_params=offload != "optimizer")
  # Up to scalars (Adam's count, the step, the rng key).
  assert 0 <= measured["pinned_host"] - est.host <= 16
  assert 0 <= measured["device"] - est.persistent <= 32


# -------------------------------------------------------------------- CLI


@pytest.mark.parametrize("text,value", [
    ("7.5e9", 7.5e9), ("1.3B", 1.3e9), ("125M", 125e6), ("350k", 350e3),
    ("1_000", 1000), ("2t", 2e12)])
def test_parse_count(text, value):
  assert parse_count(text) == pytest.approx(value)


def test_cli_prints_every_stage(capsys):
  assert main(["--params", "125M", "--devices", "8"]) == 0
  out = capsys.readouterr().out
  for stage in range(4):
    assert f"stage {stage}:" in out
  for row in ("params", "gradients", "optimizer state", "activations",
              "total", "communication per step"):
    assert row in out
  # Stage 3, fp32 Adam: 16Ψ/N for zero_jax and the paper alike.
  stage3 = out[out.index("stage 3:"):]
  total = next(l for l in stage3.splitlines() if "model states" in l)
  assert total.split()[-2:] == [f"{16 * 125e6 / 8 / GIB:.3f}"] * 2


def test_cli_activations_and_mixed_precision(capsys):
  assert main(["--params", "1.3B", "--devices", "16", "--replica", "2",
               "--stage", "2", "--compute-dtype", "bf16", "--layers", "24",
               "--hidden", "2048", "--seq-len", "2048", "--micro-batch", "1",
               "--heads", "16", "--vocab", "50257"]) == 0
  out = capsys.readouterr().out
  assert "stage 2:" in out and "stage 1:" not in out
  assert "K = 12" in out and "N = 8" in out
  acts = estimate_activations(layers=24, hidden=2048, seq_len=2048,
                              micro_batch=1, heads=16, vocab=50257)
  assert f"{acts / GIB:.3f}" in out


def _row(out: str, name: str) -> list[str]:
  return next(l for l in out.splitlines()
              if l.strip().startswith(name)).split()[-2:]


def test_cli_model_parallel(capsys):
  # The paper's 1T model on 1024 GPUs, MP 16 x DP 64: 15.625e9 bytes.
  assert main(["--params", "1T", "--devices", "1024", "--model-parallel",
               "16", "--stage", "3", "--compute-dtype", "bf16"]) == 0
  out = capsys.readouterr().out
  assert "(model parallel M = 16, sharded over N = 64, replica groups R = 1)" \
      in out
  assert "Ψ/M = 62.5B parameters" in out
  assert "stage 3: optimizer state, gradients and parameters sharded " \
      "(model parallel M = 16, data N = 64)" in out
  assert _row(out, "model states") == [f"{15.625e9 / GIB:.3f}"] * 2
  # ZeRO's collectives of Ψ/M: 3Ψ/M = 0.1875Ψ.
  # (bf16 gradients summed in fp32 cross in bf16, by an all-to-all.)
  assert "all-to-all 0.0625Ψ + all-gather 0.125Ψ; volume 0.188Ψ" in out
  # Every row is estimate_memory's and paper_estimate's, with replica
  # groups on top, and the activations stay as given.
  shape = dict(layers=4, hidden=256, seq_len=128, micro_batch=2, heads=4)
  assert main(["--params", "1.3B", "--devices", "16", "--replica", "2",
               "--model-parallel", "2", "--stage", "1"] +
              [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()]) == 0
  out = capsys.readouterr().out
  assert "M = 2, sharded over N = 4, replica groups R = 2" in out
  acts = estimate_activations(**shape, bytes_per_element=4)
  est = estimate_memory(1.3e9, 16, 1, replica=2, model_parallel=2,
                        activations=acts)
  paper = paper_estimate(1.3e9, 4, 1, param_bytes=4, grad_bytes=4, k=8,
                         model_parallel=2)
  for name, ours, theirs in (("params", est.params, paper.params),
                             ("gradients", est.grads, paper.grads),
                             ("optimizer state", est.opt_state,
                              paper.opt_state),
                             ("total", est.total, paper.model_states)):
    assert _row(out, name) == [f"{ours / GIB:.3f}", f"{theirs / GIB:.3f}"]
  assert _row(out, "activations") == [f"{acts / GIB:.3f}", "-"]
  assert "counted as without model parallelism, an upper bound" in out
  # Without model parallelism the header says M = 1.
  assert main(["--params", "1.3B", "--devices", "8", "--stage", "3"]) == 0
  out = capsys.readouterr().out
  assert "model parallel M = 1, sharded over N = 8" in out
  assert "Ψ/M" not in out and "communication per step: " in out


@pytest.mark.parametrize("argv,message", [
    (["--params", "1.3X", "--devices", "8"], "invalid count '1.3X'"),
    (["--params", "1e9", "--devices", "8", "--model-parallel", "3"],
     "--devices 8 is not divisible by --replica 1 x --model-parallel 3 = 3: "
     "each data-parallel rank is a group of --model-parallel devices; choose "
     "a --model-parallel (and --replica) whose product divides --devices"),
    (["--params", "1e9", "--devices", "8", "--replica", "2",
      "--model-parallel", "8"],
     "--devices 8 is not divisible by --replica 2 x --model-parallel 8 = 16"),
    (["--params", "1e9", "--devices", "8", "--model-parallel", "0"],
     "argument --model-parallel: must be >= 1, got 0"),
    (["--params", "1e9", "--devices", "8", "--model-parallel", "2.5"],
     "argument --model-parallel: expected an integer, got '2.5'"),
    (["--params", "1e9", "--devices", "8", "--replica", "3"],
     "--devices 8 is not divisible by --replica 3"),
    (["--params", "1e9", "--devices", "8", "--optimizer", "adamx"],
     "'adamw'"),
    (["--params", "1e9", "--devices", "0"], "must be >= 1"),
    (["--params", "1e9", "--devices", "8", "--stage", "4"], "invalid choice"),
    (["--params", "1e9", "--devices", "8", "--layers", "4"],
     "missing --hidden --seq-len --micro-batch --heads"),
    (["--devices", "8"], "--params"),
    # Shapes that cannot exist: heads must divide the width.
    (["--params", "1e9", "--devices", "8", "--layers", "2", "--hidden", "7",
      "--heads", "2", "--seq-len", "16", "--micro-batch", "1"],
     "--hidden 7 is not divisible by --heads 2"),
    # Results beyond any 64-bit machine (finite, but 3.7e13 GiB of
    # activations, or 1.5e292 GiB of model states): a slip in the sizes.
    (["--params", "1B", "--devices", "8", "--stage", "3", "--layers",
      "100000", "--hidden", "1000000", "--heads", "8", "--seq-len",
      "1000000", "--micro-batch", "100000"],
     "--layers 100000 --hidden 1000000 --seq-len 1000000 --micro-batch "
     "100000 --heads 8 give 4e+22 bytes of activations per device"),
    (["--params", "1e300", "--devices", "8"],
     "--params 1e+300 with --k 8 gives 1.6e+301 bytes of memory per "
     "device at stage 0"),
    (["--params", "2e18", "--devices", "64", "--stage", "3"],
     "--params 2e+18 with --k 8 gives 2.4e+19 bytes of communication per "
     "step"),
    (["--params", "1e9", "--devices", "8", "--layers", "1", "--hidden",
      "1" + "0" * 400, "--heads", "1", "--seq-len", "1", "--micro-batch",
      "1"], "int too large to convert to float; check these sizes"),
])
def test_cli_rejects_bad_input(capsys, argv, message):
  with pytest.raises(SystemExit) as e:
    main(argv)
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def test_cli_compiles_only_the_models_it_is_handed(capsys):
  # (analysis comes before models: python -m zero_jax.estimate hands its
  # main zero_jax.models, whose reference GPT --compile builds.)
  with pytest.raises(SystemExit) as e:
    main(["--compile", "h100", "--devices", "1", "--layers", "2", "--hidden",
          "64", "--heads", "4", "--vocab", "64", "--seq-len", "16",
          "--micro-batch", "2"])
  assert e.value.code == 2
  assert "run python -m zero_jax.estimate" in capsys.readouterr().err


def test_cli_takes_sizes_a_64_bit_machine_can_hold(capsys):
  # 1e18 parameters: 1.6e19 bytes of plain data parallelism, below 2^64.
  assert main(["--params", "1e18", "--devices", "8", "--stage", "0"]) == 0
  assert "stage 0:" in capsys.readouterr().out


def test_cli_as_a_module():
  out = subprocess.run(
      [sys.executable, "-m", "zero_jax.estimate", "--params", "7.5e9",
       "--devices", "64", "--stage", "3"],
      cwd=_REPO, capture_output=True, text=True, check=True,
      env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
  assert "stage 3:" in out and "stage 2:" not in out
  # 16Ψ/N = 1.875e9 bytes = 1.746 GiB per device; 3Ψ of communication.
  assert "1.746" in out and "volume 3Ψ" in out


def test_cli_offload_rows(capsys):
  assert main(["--params", "13e9", "--devices", "1", "--stage", "3",
               "--compute-dtype", "bf16", "--offload-optimizer"]) == 0
  out = capsys.readouterr().out
  # 12 bytes/param (fp32 master + Adam) on the host, and the 4 of the fp32
  # gradients, sent there as backward makes them; 2 (the bf16 copy) on the
  # device.
  row = lambda name: float([l for l in out.splitlines()
                            if name in l][0].split()[2])
  assert row("host (offloaded)") == pytest.approx(12 * 13e9 / 2**30,
                                                  rel=1e-3)
  assert row("host (gradients)") == pytest.approx(4 * 13e9 / 2**30,
                                                  rel=1e-3)
  assert row("model states") == pytest.approx(2 * 13e9 / 2**30, rel=1e-3)
