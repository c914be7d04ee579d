"""The GPU benchmark's code path, on CPU with tiny models.

The figures are only meaningful on a GPU (experiments/gpu_bench.py); this
checks that every mode trains, is measured and is written out.
"""

import json
import os
import sys

_EXPERIMENTS = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "experiments")
sys.path.insert(0, _EXPERIMENTS)

import gpu_bench  # noqa: E402  pylint: disable=g-import-not-at-top


def test_every_mode_trains_and_is_reported(tmp_path):
  results = []
  # (Offload with the update on the device is tests/test_offload.py's.)
  modes = [m for m in gpu_bench.MODES if "offload" not in m or "host" in m]
  for mode in modes:
    r = gpu_bench.run_one(gpu_bench.Run("tiny", mode, batch=2, seq_len=32,
                                        steps=2, tiny=True))
    assert r["status"] == "ok" and r["tokens_per_s"] > 0
    assert r["compiled_device_bytes"] > 0 and len(r["losses"]) == 2
    assert r["mfu"] is None  # no known peak on CPU
    results.append(r)
  # Same model, same data, same first step: every mode starts at the same
  # loss (bf16 forward).
  first = [r["losses"][0] for r in results]
  assert max(first) - min(first) < 1e-2 * abs(first[0])
  results.append(dict(results[1], capacity=True))
  gpu_bench.write_results(results, str(tmp_path))
  md = (tmp_path / "gpu_bench.md").read_text()
  assert "step time / baseline" in md and "step time / no offload" in md
  assert "update on host: step time / no offload" in md
  assert "largest model that trains, zero_jax stage 3: tiny" in md
  assert "update on host, delayed: step time / no offload" in md
  assert len(json.loads((tmp_path / "gpu_bench.json").read_text())) == (
      len(modes) + 1)


def test_plan_walks_the_ladder_from_1_3b():
  args = gpu_bench.argparse.Namespace(
      tiny=False, batch=16, capacity_batch=4, steps=6, speed_sizes=None,
      capacity_from=None)
  speed, ladder = gpu_bench.plan_runs(args)
  assert {r.size for r in speed} == {"125m", "1.3b"}
  assert len(speed) == 2 * len(gpu_bench.MODES)
  assert ladder[0].size == "1.3b" and ladder[-1].size == "30b"
