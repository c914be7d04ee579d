"""Memory and collectives of steps compiled for H100s (``zero_jax.analysis``).

No GPU is needed: the step is compiled for 8 (or 1) compile-only H100s, so
these are the programs a GPU user runs. What they show that the CPU-compiled
tests cannot: 16-bit collectives stay 16-bit (and ZeRO++'s quantized ones
8-bit), the GPU scheduler's placement of gathers, and host offload's memory
spaces. The reference figures are a real H100 80GB's (jax 0.11.2,
2026-11-23).

Programs compiled for GPUs are not kept by the persistent compilation
cache, so each costs its full compile time every run: every step here is
compiled once (``_shared.compile_gpt``, which the command line's tests go
through too), and the tests that read the same step share it.
"""

import functools
import importlib.util
import math
import re
import types

import jax
import optax
import pytest

import zero_jax as zj
from tests import _models as m
from tests.analysis import _shared
from tests._gpu import compiles_for_gpus
from zero_jax import analysis
from zero_jax import models
from zero_jax.analysis import param_count
from zero_jax.estimate import main
from zero_jax.models import compile_gpt

pytestmark = compiles_for_gpus

N = 8
GIB = 2 ** 30
# The tiny GPT of the collective tests: 4 scanned layers of width 128.
_TINY = dict(layers=4, hidden=128, heads=4, vocab=64, seq_len=16,
             micro_batch=2)
# The reference GPT (vocabulary 50304, sequence 1024), batch 16 on one GPU.
_1_3B = dict(layers=24, hidden=2048, heads=16, vocab=50304, seq_len=1024,
             micro_batch=16)


# (Without prefetch, whose first and last layers are gathered and reduced
# twice: tests/layers/test_prefetch.py counts its collectives. The
# per-device step's own collectives: the global step's are
# tests/train/test_loss_scope.py's.)
def _tiny(stage, compute_dtype="bfloat16", layers=4, overrides=None,
          **options):
  return _shared.compile_gpt(
      "h100", N, stage, compute_dtype=compute_dtype,
      overrides={"prefetch": False, "loss_scope": "per_device",
                 **(overrides or {})},
      **dict(_TINY, layers=layers), **options)


def _sharded_elements(engine):
  return sum(math.prod(lp.shape) for _, lp in engine.param_plan.rows()
             if lp.sharded)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_parameter_gathers_stay_bf16(stage):
  engine, c = _tiny(stage)
  gathers = {dt: d for (kind, dt), d in c.collectives.items()
             if kind == "all-gather"}
  # Every parameter gather moves bf16: half the bytes of fp32. (A
  # CPU-compiled step upcasts them to f32.)
  assert set(gathers) == {"bf16"}, gathers
  d = gathers["bf16"]
  assert d["bytes"] == 2 * d["elements"]
  sharded = _sharded_elements(engine)
  if stage in (1, 2):
    # The updated master shards, gathered once into the compute copy.
    assert d["elements"] == sharded
  else:
    in_scan = sum(math.prod(lp.shape) for path, lp in
                  engine.param_plan.rows()
                  if lp.sharded and path.startswith("blocks/"))
    assert 2 * in_scan <= d["elements"] <= 2 * sharded


def test_bf16_gathers_carry_half_the_bytes_of_fp32_ones():
  _, bf16 = _tiny(3)
  _, fp32 = _tiny(3, compute_dtype=None)
  assert fp32.collectives[("all-gather", "f32")]["elements"] == (
      bf16.collectives[("all-gather", "bf16")]["elements"])
  assert 2 * bf16.collective_bytes("all-gather") == (
      fp32.collective_bytes("all-gather"))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_cross_in_bf16_and_are_summed_in_fp32_on_the_shard(stage):
  engine, c = _tiny(stage)
  psi, rep = c.params, engine.param_plan.replicated_elements
  ops = {}
  for (kind, _), d in c.collectives.items():
    ops[kind] = ops.get(kind, 0) + d["elements"]
  # Gradients are summed in fp32 (reduce_dtype's default), but every
  # sharded leaf's whole bf16 gradient crosses once, by an all-to-all that
  # hands each device every device's block of its shard, summed there in
  # fp32: a fp32 reduce-scatter's sums for half its bytes.
  assert ops["all-to-all"] == _sharded_elements(engine)
  assert [dt for kind, dt in c.collectives if kind == "all-to-all"] == [
      "bf16"]
  assert "reduce-scatter" not in ops
  # Only the small replicated leaves' gradients and the loss are
  # all-reduced: nothing of the size of the model.
  assert ops.get("all-reduce", 0) <= rep + 16
  assert rep < 0.05 * psi


def test_bf16_sums_are_a_bf16_reduce_scatter():
  engine, _ = _tiny(3)
  _, c = _tiny(3, reduce_dtype="bfloat16")
  assert c.collectives[("reduce-scatter", "bf16")]["elements"] == (
      _sharded_elements(engine) // N)
  assert not any(kind == "all-to-all" for kind, _ in c.collectives)


# ZeRO++'s quantized collectives: qwZ's parameter all-gathers move int8
# blocks and their float32 scales, about half a bf16 gather's bytes; qgZ's
# gradients cross as int8 blocks by an all-to-all, about a quarter of a
# float32 reduce-scatter's. (A CPU-compiled step would show neither: it
# upcasts narrow collectives.) Against the stage-3 step above.


def test_qwz_gathers_int8_blocks_for_about_half_the_bf16_bytes():
  _, plain = _tiny(3)
  _, q = _tiny(3, overrides={"quantized_weights": True})
  dtypes = {dt for kind, dt in q.collectives if kind == "all-gather"}
  assert dtypes == {"s8", "f32"}, dtypes
  # The same elements cross, int8 instead of bf16, plus a float32 scale
  # per block of 256.
  assert q.collectives[("all-gather", "s8")]["elements"] == (
      plain.collectives[("all-gather", "bf16")]["elements"])
  ratio = q.collective_bytes("all-gather") / plain.collective_bytes(
      "all-gather")
  assert 0.5 < ratio <= 0.55, ratio


def test_qgz_sends_int8_gradient_blocks_for_a_quarter_of_fp32_bytes():
  engine, q = _tiny(3, overrides={"quantized_gradients": True})
  kinds = {(kind, dt) for kind, dt in q.collectives if kind in (
      "all-to-all", "reduce-scatter")}
  assert kinds == {("all-to-all", "s8"), ("all-to-all", "f32")}, kinds
  # A float32 reduce-scatter of every sharded gradient moves 4 bytes an
  # element.
  fp32 = 4 * _sharded_elements(engine)
  assert q.collectives[("all-to-all", "s8")]["elements"] == (
      _sharded_elements(engine))
  ratio = q.collective_bytes("all-to-all") / fp32
  assert 0.25 < ratio <= 0.3, ratio


def test_stage3_temp_grows_by_the_added_layers_shards_not_their_params():
  # Twice the layers: with per-layer gathering, temp grows by the added
  # layers' fp32 gradient shards and the update's temporaries on the shards
  # (4 + 4 bytes a parameter over N) and their saved inputs; not by their
  # full parameters. (Measured: 0.89 bytes a parameter at N = 8.)
  _, four = _tiny(3)  # (the cached 4-layer step)
  _, eight = _tiny(3, layers=8)
  added = eight.params - four.params
  saved_acts = 4 * (2 * 16 * 128) * 2   # 4 layers x (B/N, T, d) bf16
  growth = eight.memory.temp - four.memory.temp
  assert growth <= 8 * added / N + saved_acts + 64 * 1024, (growth, added)
  # Gathering the whole model would add at least the added bf16 params.
  assert growth < 2 * added


def test_reference_gpt_peak_matches_a_real_h100():
  # (A real H100 also measured the 125M step, 6.8 GiB, which compiles to
  # 6.83.)
  _, c = _shared.compile_gpt("h100", 1, 3, **_1_3B)
  assert c.memory.host == 0
  assert abs(c.memory.peak / GIB - 27.8) <= 0.05 * 27.8, c.memory.peak / GIB


# Model state dominates: 4 wide layers, short sequences, one device. The
# slice budget is lowered so that these leaves are cut as a 1.3B model's are.
_WIDE = dict(layers=4, hidden=1024, heads=8, vocab=1024, seq_len=32,
             micro_batch=1)
_SLICE_BYTES = 4 << 20


@functools.cache
def _wide(loss_scope="per_device", **options):
  """``compile_gpt`` of the wide shape on one H100 with the lowered slice
  budget (which only the streamed update reads), once per options. (The
  per-device step's unless asked: the global one's offload is
  test_the_global_loss_offloads_as_the_per_device_step's.)"""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr("zero_jax.offload._stream.SLICE_BYTES", _SLICE_BYTES)
    return compile_gpt("h100", 1, 3, **_WIDE, **options,
                       overrides={"loss_scope": loss_scope})


def test_offloaded_optimizer_state_is_compiled_into_host_memory():
  _, c = _wide(offload_optimizer=True)
  entry = c.hlo.splitlines()[0]
  # The entry layout puts the offloaded parameters in memory space 5 (host).
  assert "entry_computation_layout" in entry and "S(5)" in entry
  # fp32 master + two Adam moments (12 bytes a parameter) on the host, apart
  # from the device figures, and the fp32 gradients of the streamed leaves
  # (all but the small ones: measured 15.99 bytes a parameter in all here,
  # 15.7 at 1.3B).
  assert 15 * c.params <= c.memory.host <= 16 * c.params
  assert c.memory.argument < 0.3 * 12 * c.params
  # The update streams the state through the device a slice at a time, and
  # the gradient shards go to the host as backward makes them: the peak is
  # at most 0.6x the peak without offload (measured 0.26x here and 0.34x at
  # 1.3B; the whole-state copy it replaced measured 30.7 GiB on a real H100
  # at 1.3B, 1.1x).
  _, plain = _wide()
  assert c.memory.peak <= 0.60 * plain.memory.peak, (
      c.memory.peak / GIB, plain.memory.peak / GIB)


_COPIES = (" copy-start(", " copy(", "dynamic-slice-start", " dynamic-slice(")


def _host_copies(hlo: str) -> list[tuple[str, str, int]]:
  """(computation, instruction, elements of the host array) of every copy
  or dynamic slice that reads host memory (layout ``S(5)``)."""
  out, comp = [], None
  for line in hlo.splitlines():
    if line and not line.startswith(" ") and "{" in line:
      comp = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
    if "S(5)" in line and any(k in line for k in _COPIES):
      dims = re.search(r"\[([\d,]*)\]\{[\d,]*:S\(5\)", line).group(1)
      out.append((comp.lstrip("%"), line,
                  math.prod(int(d) for d in dims.split(",") if d)))
  return out


def test_streamed_update_copies_one_slice_per_iteration():
  _, plain = _wide()
  engine, opt = _wide(offload_optimizer=True)
  both_engine, both = _wide(offload_optimizer=True, offload_params=True)
  assert opt.memory.peak <= 0.60 * plain.memory.peak
  assert both.memory.peak <= 0.40 * plain.memory.peak
  # Nothing runs on the host: XLA marks any computation it had to move
  # there (a slow path) with this attribute.
  for c in (opt, both):
    assert '_xla_compute_type="host"' not in c.hlo
  # What reads host memory: dynamic slices inside the update's loops, and
  # whole copies of leaves below the slice budget only.
  bodies = {line.split("body=")[1].split(",")[0].lstrip("%")
            for line in opt.hlo.splitlines() if " while(" in line}
  copies = _host_copies(opt.hlo)
  assert any("dynamic-slice" in line for _, line, _ in copies)
  for comp, line, elements in copies:
    if "dynamic-slice" in line:
      assert comp in bodies or comp.startswith("wrapped"), (comp, line)
    else:
      assert 4 * elements <= _SLICE_BYTES, line
  cut = [k for k, _ in engine.layout.update.streamer.calls if k > 1]
  assert cut and min(cut) >= 4
  # PCIe per step: the streamed update reads master and both moments (12
  # bytes a parameter) and the fp32 gradient shards twice (the norm, then
  # the update: 8), and writes the state and the gradients back (16).
  # Measured 19.9 and 16.5 here; 20.2 and 15.6 at 1.3B.
  psi = opt.params
  assert 19 * psi <= opt.transfers.to_device <= 21 * psi, (
      opt.transfers.to_device / psi)
  assert 15 * psi <= opt.transfers.to_host <= 17 * psi, (
      opt.transfers.to_host / psi)
  # describe() states these bytes, counted from the layout: within 3% of
  # the compiled program's (measured 0.0% and 1.0% here; with
  # offload_params, whose layers are gathered from the host master in
  # forward and backward, 0.6% and 1.0%).
  for e, c in ((engine, opt), (both_engine, both)):
    down, up = e.layout.update.traffic(e.layout)
    assert abs(down - c.transfers.to_device) <= 0.03 * c.transfers.to_device
    assert abs(up - c.transfers.to_host) <= 0.03 * c.transfers.to_host
    assert f"{down / 2**20:,.1f} MiB to the device" in e.describe()
  # Without offload nothing crosses.
  assert plain.transfers.total == 0


def test_host_update_leaves_the_device_the_compute_copy():
  # update_on="host": the device's program reads only the bf16 copy (and
  # the batch), writes the fp32 gradient shards to host memory as backward
  # makes them, and computes nothing on the host; master and moments never
  # enter it.
  _, plain = _wide()
  engine, host = _wide(offload_optimizer=True, update_on="host")
  assert host.memory.peak <= 0.40 * plain.memory.peak
  assert host.memory.argument <= 2.05 * host.params
  assert 3.95 * host.params <= host.memory.host <= 4.05 * host.params
  assert '_xla_compute_type="host"' not in host.hlo
  est = zj.estimate_memory(host.params, 1, 3, compute_dtype="bfloat16",
                           offload_optimizer=True, update_on="host")
  assert est.params == 2 * host.params and est.host == 12 * host.params
  assert "host update over" in engine.describe()
  # PCIe per step: the fp32 gradient shards go down (4 bytes a parameter,
  # in the program, as backward makes them) and the bf16 copy comes up (2,
  # given to the next step); the program itself reads nothing from the
  # host.
  assert analysis.host_transfers(host.hlo).to_device == 0
  assert 3.95 * host.params <= host.transfers.to_host <= 4.05 * host.params
  assert host.transfers.to_device == 2 * host.params
  assert 5.95 <= host.transfer_bytes_per_param() <= 6.05
  # ZeRO-Offload's 4 bytes: with reduce_dtype bf16 the gradient shards go
  # down in bf16 (the reduce-scatter's own sums), and nothing else moves.
  _, half = _wide(offload_optimizer=True, update_on="host",
                  reduce_dtype="bfloat16")
  assert 1.95 * half.params <= half.transfers.to_host <= 2.05 * half.params
  assert half.transfers.to_device == 2 * half.params
  assert half.transfer_bytes_per_param() <= 4.05


@pytest.mark.parametrize("update_on", ["device", "host"])
def test_the_global_loss_offloads_as_the_per_device_step(update_on):
  # The default global loss, its gradients summed in bf16: stage 3 sends
  # each gradient shard to host memory as backward makes it (in bf16 for
  # the host's update, its sums as they are), as the per-device step with
  # the same sums does, for about its peak.
  options = dict(offload_optimizer=True, update_on=update_on)
  _, per_device = _wide(reduce_dtype="bfloat16", **options)
  _, glob = _wide("global", **options)
  print(f"\nupdate on the {update_on}: peak {glob.memory.peak / GIB:.3f} "
        f"GiB (per device {per_device.memory.peak / GIB:.3f}), to host "
        f"{glob.transfers.to_host / glob.params:.2f} bytes a parameter "
        f"({per_device.transfers.to_host / per_device.params:.2f})")
  assert glob.memory.host == per_device.memory.host
  assert glob.transfers.to_host == per_device.transfers.to_host
  assert glob.memory.peak <= 1.1 * per_device.memory.peak


@pytest.mark.parametrize("offload", [
    dict(offload_optimizer="host"),
    dict(offload_optimizer="host", offload_params="host"),
])
def test_abstract_state_keeps_memory_kinds_on_compile_only_gpus(offload):
  # A sharding built on compile-only devices silently drops "pinned_host";
  # the engine's are built on the abstract mesh, so they keep it, exactly as
  # on real devices.
  loss_fn, params, _ = m.gpt_setup(d_model=32, n_layers=2, steps=1)
  config = zj.ZeroConfig(stage=3, compute_dtype="bfloat16", **offload)
  kinds = []
  for mesh in (analysis.gpu_mesh("h100", N), zj.make_mesh(num_devices=N)):
    state = zj.Engine(loss_fn, optax.adam(1e-3), config,
                      mesh).abstract_state(params)
    # (None is the default memory: the device's.)
    kinds.append([x.sharding.memory_kind or "device"
                  for x in jax.tree.leaves(state)])
  on_gpus, on_cpus = kinds
  assert "pinned_host" in on_gpus
  assert on_gpus == on_cpus


def test_offloaded_init_compiles_for_gpus():
  # A compute_on'd init aborted XLA on an H100; init now builds the state
  # from device copies of the shards and writes it back to the host.
  loss_fn, params, _ = m.gpt_setup(d_model=32, n_layers=2, steps=1)
  mesh = analysis.gpu_mesh("h100", N)
  engine = zj.Engine(loss_fn, optax.adam(1e-3), zj.ZeroConfig(
      stage=3, offload_optimizer="host", offload_params="host"), mesh)
  with jax.set_mesh(mesh):
    compiled = engine.lower_init(params).compile()
  host = compiled.memory_analysis().host_output_size_in_bytes
  # The master shard and both Adam moments are written to host memory.
  assert host >= 12 * (param_count(params) -
                       engine.param_plan.replicated_elements) // N


def test_every_target_describes_its_gpu_and_an_a100_compiles():
  kinds = {t: analysis.gpu_devices(t, 2)[0].device_kind
           for t in analysis.TARGETS}
  assert kinds == {"h100": "NVIDIA H100 80GB HBM3",
                   "h200": "NVIDIA H200 141GB HBM3e",
                   "a100-80gb": "NVIDIA A100-SXM4-80GB"}
  # Another architecture (sm_80) than the H100s of the other tests.
  _, c = _shared.compile_gpt("a100-80gb", 2, 3, **dict(_TINY, layers=2))
  assert c.collective_bytes("all-gather") > 0 and c.memory.peak > 0


def test_unknown_target_and_missing_extra_name_the_fix(monkeypatch, capsys):
  with pytest.raises(ValueError, match="a100-80gb, h100, h200"):
    analysis.gpu_devices("v100")
  with pytest.raises(SystemExit) as e:
    main(["--compile", "b200", "--devices", "1", *_cli_shape()])
  assert e.value.code == 2
  assert "unknown --compile target 'b200'" in capsys.readouterr().err
  monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
  with pytest.raises(ImportError, match=r"gpu-compile"):
    analysis.gpu_devices("h100")
  with pytest.raises(SystemExit) as e:
    main(["--compile", "h100", "--devices", "1", *_cli_shape()])
  assert e.value.code == 2
  assert "jax[cuda12]" in capsys.readouterr().err


def _cli_shape():
  return ["--layers", "4", "--hidden", "128", "--heads", "4", "--vocab", "64",
          "--seq-len", "16", "--micro-batch", "2"]


def test_cli_prints_the_compiled_step(monkeypatch, capsys):
  # _TINY on 8 compile-only H100s as data 4 x model 2
  # (gpu_mesh("h100", 8, model=2)): the step the tensor-parallel test below
  # compiles, compiled once for both (the command line calls the
  # compile_gpt of the models it is handed).
  gpt = types.SimpleNamespace(gpt_shapes=models.gpt_shapes,
                              compile_gpt=_shared.compile_gpt)
  assert analysis.main(
      ["--compile", "h100", "--devices", "8", "--model-parallel", "2",
       "--stage", "3", "--compute-dtype", "bf16", "--attention", "auto",
       *_cli_shape()], gpt=gpt) == 0
  out = capsys.readouterr().out
  peak = [line for line in out.splitlines() if "peak" in line and
          "compiled for 8 x h100 (data 4 x model 2)" in line]
  assert len(peak) == 1 and "GiB" in peak[0]
  # The compiled step's own figures.
  _, c = _shared.compile_gpt("h100", N, 3, model=2, attention="auto",
                             **_TINY)
  assert f"peak {c.memory.peak / GIB:.3f} GiB" in peak[0]
  assert "all-gather bf16" in out and "all-to-all bf16" in out
  assert "model parallel M = 2, sharded over N = 4" in out
  # --micro-batch sequences per data-parallel rank: 2 x 4.
  assert "global batch 8 x 16 tokens" in out


def test_tensor_parallel_collectives_run_along_their_axes():
  # Compiled for 8 H100s as (data 4, model 2): ZeRO's gathers and
  # gradient reduce-scatters (bf16 sums: the default global loss's) run
  # along 'data' on each model rank's bf16 slice, the compiler's
  # tensor-parallel collectives along 'model'.
  # (attention="auto": the einsum under tensor parallelism.)
  engine, c = _shared.compile_gpt("h100", N, 3, model=2, attention="auto",
                                  **_TINY)
  mesh = engine.mesh
  along = {}
  for op in analysis.collectives(c.hlo):
    along.setdefault((op.kind, op.axes(mesh)), []).append(op)
  assert ("all-gather", ("data",)) in along, sorted(along)
  assert ("reduce-scatter", ("data",)) in along, sorted(along)
  assert any(axes == ("model",) for _, axes in along), sorted(along)
  assert "bf16" in {d for op in along[("all-gather", ("data",))]
                    for d in op.dtypes}
  # A column-parallel layer's gather holds its model rank's half: the
  # (d, 4 d) MLP-in layer gathers to 4 blocks of (32, 256) (one per
  # 'data' device, stacked as GPU collectives concatenate), never to a
  # (d, 4 d) whole.
  shapes = {s for op in along[("all-gather", ("data",))] for s in op.shapes}
  assert (4, 32, 256) in shapes, shapes
  assert not {(128, 512), (4, 32, 512)} & shapes, shapes


def test_cudnn_attention_is_refused_under_tensor_parallelism():
  with pytest.raises(ValueError, match="attention='cudnn'.*'model'"):
    compile_gpt("h100", N, 3, model=2, attention="cudnn",
                compute_dtype="bfloat16", **_TINY)
  # ("auto" takes the einsum there: the test above compiles it.)
