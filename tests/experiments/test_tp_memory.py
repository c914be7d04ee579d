"""experiments/tp_memory.py at small shapes: ZeRO-3 with tensor parallelism
compiled for 8 H100s (no GPU needed).

The script is run as a user would (``--quick``: a 7.4M-parameter GPT,
model 2 x data 4, with and without Pa, and model 1 x data 8) and its JSON
is checked: the state per device is 12Ψ/(D·M) up to the leaves the model
keeps whole, and exactly what the layout predicts; Pa splits the saved
layer inputs over ``model``; tensor parallelism lowers the peak. The
benchmark is not imported: tests and experiments stay independent.
"""

import json
import os
import subprocess
import sys

import pytest

from tests._gpu import compiles_for_gpus

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_SCRIPT = os.path.join(_ROOT, "experiments", "tp_memory.py")
# --quick's GPT and mesh.
L, S, D_MODEL, M, N = 8, 128, 256, 2, 8


def _run(*args, timeout=600):
  env = dict(os.environ, PYTHONPATH=_ROOT)
  out = subprocess.run([sys.executable, _SCRIPT, *args], env=env,
                       capture_output=True, text=True, timeout=timeout)
  assert out.returncode == 0, out.stdout + out.stderr
  return out


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
  """The ``--quick`` run's JSON: ``{"rows": [...], "pa": [...]}``."""
  out_dir = tmp_path_factory.mktemp("tp_memory")
  out = _run("--quick", "--out-dir", str(out_dir))
  # Progress on stderr, one line before and one after each compile.
  assert out.stderr.count("compiling") == 3, out.stderr
  report = json.loads((out_dir / "tp_memory_h100.json").read_text())
  md = (out_dir / "tp_memory_h100.md").read_text()
  assert "PYTHONPATH=. python experiments/tp_memory.py --quick" in md
  return report


def _rows(report):
  rows = {(r["model"], r["pa"]): r for r in report["rows"]}
  assert set(rows) == {(M, True), (M, False), (1, False)}
  for r in rows.values():
    assert r["status"] == "ok", r
  return rows


@compiles_for_gpus
def test_state_per_device_is_twelve_psi_over_d_times_m(quick):
  for (m, _), r in _rows(quick).items():
    assert r["mesh"] == ({"data": N} if m == 1 else
                         {"data": N // m, "model": m})
    assert r["ideal_state_bytes"] == 12 * r["psi"] / N
    # fp32 master + Adam's two moments, split over all N = D x M devices,
    # but for the leaves the model keeps whole (position embedding, layer
    # norms, row-parallel biases): every model rank holds those.
    assert abs(r["state_ratio"] - 1) < 0.02, r["state_ratio"]
    # Exactly the layout's prediction from the model's own specs, plus
    # Adam's step count (an int32 on every device).
    assert r["state_bytes"] - r["layout_state_bytes"] == 4
    # What the compiled step takes is the train state and the batch.
    assert r["argument_minus_state_and_batch"] == 0
    assert r["state_fields_bytes"]["compute_params"] == 0  # stage 3
  rows = _rows(quick)
  # Tensor parallelism splits what the model splits, so the model-M state
  # is above 12Ψ/N by exactly the (M-1) extra copies of the whole leaves.
  assert rows[(M, True)]["state_ratio"] > rows[(1, False)]["state_ratio"]


@compiles_for_gpus
def test_pa_splits_the_saved_layer_inputs_over_model(quick):
  rows = _rows(quick)
  inputs = L * 1 * S * D_MODEL * 2  # bf16 layer inputs, micro-batch 1
  without = rows[(M, False)]["saved_carry"]
  with_pa = rows[(M, True)]["saved_carry"]
  # The scan's stacked residual: whole without Pa, 1/M of the sequence
  # with it, in the compute dtype.
  assert without == {"shape": f"[{L},1,{S},{D_MODEL}]", "dtype": "bf16",
                     "bytes": inputs, "seq": S}
  assert with_pa == {"shape": f"[{L},1,{S // M},{D_MODEL}]",
                     "dtype": "bf16", "bytes": inputs // M, "seq": S // M}
  (pa,) = quick["pa"]
  assert pa["layer_input_bytes"] == inputs
  required = (M - 1) / M * inputs
  assert pa["required_saving_bytes"] == required
  # At least (M-1)/M of the layer inputs saved: in the buffer itself, in
  # the step's temporaries and in its peak.
  assert pa["carry_saving_bytes"] >= required
  assert pa["temp_saving_bytes"] >= required
  assert pa["peak_saving_bytes"] >= required
  assert pa["carry_saving_ok"] and pa["peak_saving_ok"] and (
      pa["temp_saving_ok"])


@compiles_for_gpus
def test_tensor_parallelism_lowers_the_peak(quick):
  rows = _rows(quick)
  one = rows[(1, False)]["peak_bytes"]
  # Same N devices: each model rank gathers and computes 1/M of a layer.
  assert rows[(M, False)]["peak_bytes"] < one
  assert rows[(M, True)]["peak_bytes"] < rows[(M, False)]["peak_bytes"]


def test_full_size_plan():
  # --dry-run compiles nothing (and imports no jax): the full-size cases.
  out = _run("--dry-run")
  cases = [json.loads(line) for line in out.stdout.splitlines()]
  assert [(c["size"], c["devices"], c["model"], c["pa"]) for c in cases] == [
      ("13b", 64, 8, True), ("13b", 64, 8, False), ("13b", 64, 1, False),
      ("100b", 256, 8, True), ("100b", 256, 8, False),
      ("100b", 256, 1, False)]
  psi = {c["size"]: c["psi"] for c in cases}
  assert 12.5e9 < psi["13b"] < 13.5e9 and psi["100b"] >= 100e9
  for c in cases:
    assert (c["seq_len"], c["micro_batch"], c["target"]) == (2048, 1,
                                                               "h100")
    # Whole heads and vocabulary rows on each of the 8 model ranks.
    assert c["n_heads"] % 8 == 0 and c["vocab"] % 8 == 0
