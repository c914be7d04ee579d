"""The GPU benchmark's code path, on CPU with tiny models.

The figures are only meaningful on a GPU (benchmarks/gpu_bench.py); this
runs the script as a user would, with its tiny CPU models, and checks that
every mode trains, is measured and is written out. The benchmark is not
imported: tests and benchmarks stay independent.
"""

import json
import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SCRIPT = os.path.join(_ROOT, "benchmarks", "gpu_bench.py")
# (Offload with the update on the device is tests/test_offload.py's.)
_MODES = ["baseline (jax.jit + optax)", "zero_jax stage 3",
          "zero_jax stage 3 + offload, update on host",
          "zero_jax stage 3 + offload, update on host, delayed"]


def _bench(*args, timeout=600):
  env = dict(os.environ, PYTHONPATH=_ROOT)
  out = subprocess.run([sys.executable, _SCRIPT, *args], env=env,
                       capture_output=True, text=True, timeout=timeout)
  assert out.returncode == 0, out.stdout + out.stderr
  return out.stdout


def test_every_mode_trains_and_is_reported(tmp_path):
  # The speed runs of four modes on the tiny model, then the capacity
  # ladder from its next size (stage 3 is the only ladder mode chosen).
  _bench("--tiny", "--out-dir", str(tmp_path), "--capacity-from", "tiny2",
         "--modes", *_MODES)
  results = json.loads((tmp_path / "gpu_bench.json").read_text())
  assert len(results) == len(_MODES) + 1
  speed = [r for r in results if not r.get("capacity")]
  assert [r["mode"] for r in speed] == _MODES
  for r in results:
    assert r["status"] == "ok" and r["tokens_per_s"] > 0
    assert r["compiled_device_bytes"] > 0 and len(r["losses"]) == r["steps"]
    assert r["mfu"] is None  # no known peak on CPU
  # Same model, same data, same first step: every mode starts at the same
  # loss (bf16 forward).
  first = [r["losses"][0] for r in speed]
  assert max(first) - min(first) < 1e-2 * abs(first[0])
  md = (tmp_path / "gpu_bench.md").read_text()
  assert "step time / baseline" in md and "step time / no offload" in md
  assert "update on host: step time / no offload" in md
  assert "largest model that trains, zero_jax stage 3: tiny2" in md
  assert "update on host, delayed: step time / no offload" in md


def test_plan_walks_the_ladder_from_1_3b():
  # --dry-run prints the plan without importing jax.
  runs = [json.loads(line) for line in _bench("--dry-run").splitlines()]
  speed = [r for r in runs if not r["capacity"]]
  ladder = [r for r in runs if r["capacity"]]
  assert {r["size"] for r in speed} == {"125m", "1.3b"}
  assert len(speed) == 2 * len({r["mode"] for r in speed}) == 12
  assert ladder[0]["size"] == "1.3b" and ladder[-1]["size"] == "30b"
