"""experiments/stage3_bench.py at small shapes: zero_jax stage 3 beside the
GSPMD FSDP step, compiled for 8 H100s (no GPU needed).

The script is run as a user would (``--quick``: the tests' tiny GPT) and
its report is checked: both files are written, each run compiled in its
own subprocess, with the same persistent state per device, and every
asynchronous collective's overlap counted. The benchmark is not imported:
tests and experiments stay independent.
"""

import json
import os
import subprocess
import sys

from tests._gpu import compiles_for_gpus

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_SCRIPT = os.path.join(_ROOT, "experiments", "stage3_bench.py")


@compiles_for_gpus
def test_quick_run_writes_the_side_by_side_report(tmp_path):
  env = dict(os.environ, PYTHONPATH=_ROOT)
  out = subprocess.run([sys.executable, _SCRIPT, "--quick", "--out-dir",
                        str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stdout + out.stderr
  # Progress on stderr: a line before and one after each compile.
  assert out.stderr.count(": compiling") == 2, out.stderr
  report = json.loads((tmp_path / "stage3_h100.json").read_text())
  md = (tmp_path / "stage3_h100.md").read_text()
  assert "PYTHONPATH=. python experiments/stage3_bench.py --quick" in md
  rows = {r["run"]: r for r in report["rows"]}
  assert set(rows) == {"default", "gspmd"}
  for r in rows.values():
    assert r["status"] == "ok", r
    assert r["n"] == 8 and r["peak_bytes"] >= r["temp_bytes"] > 0
    # The overlap counts cover each collective the step runs.
    assert {k: v["total"] for k, v in r["overlap"].items()} == r["counts"]
    kinds = {c["kind"] for c in r["collectives"]}
    assert kinds == set(r["counts"])
    assert all(0 <= v["overlapped"] <= v["total"]
               for v in r["overlap"].values())
    assert r["overlap"]["all-gather"]["total"] > 0
  # The same layout of the same model: the same state on each device.
  assert rows["default"]["state_bytes"] == rows["gspmd"]["state_bytes"]
  assert rows["default"]["psi"] == rows["gspmd"]["psi"]
  assert "| tiny | 8 | GSPMD FSDP |" in md
  assert "| tiny | 8 | zero_jax stage 3 (default) |" in md


@compiles_for_gpus
def test_hpz_runs_on_two_nodes_and_reports_the_bytes_across_them(tmp_path):
  env = dict(os.environ, PYTHONPATH=_ROOT)
  out = subprocess.run([sys.executable, _SCRIPT, "--quick", "--devices",
                        "8,16", "--configs", "default,hpz", "--out-dir",
                        str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stdout + out.stderr
  rows = {(r["n"], r["run"]): r for r in json.loads(
      (tmp_path / "stage3_h100.json").read_text())["rows"]}
  # (On one node of 8 there is nothing for hpZ to keep inside it.)
  assert set(rows) == {(8, "default"), (16, "default"), (16, "hpz")}
  assert rows[8, "default"]["cross_node_bytes"] == 0
  hpz, flat = rows[16, "hpz"]["cross_node_bytes"], rows[16, "default"][
      "cross_node_bytes"]
  assert 0 < hpz * 4 < flat, (hpz, flat)
  assert rows[16, "hpz"]["state_bytes"] == rows[16, "default"]["state_bytes"]
