"""The GPU benchmark's code path, on CPU with tiny models.

The figures are only meaningful on a GPU (experiments/gpu_bench.py); this
runs the script as a user would, with its tiny CPU models, and checks that
every mode trains, is measured and is written out. The benchmark is not
imported: tests and experiments stay independent.
"""

import functools
import importlib.util
import json
import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_SCRIPT = os.path.join(_ROOT, "experiments", "gpu_bench.py")
_ZERO, _BASELINE, _TORCH = ("zero_jax stage 3", "baseline (jax.jit + optax)",
                            "torch.compile")
# (Offload with the update on the device is tests/offload/test_offload.py's.)
_OFFLOADS = ["zero_jax stage 3 + offload, update on host",
             "zero_jax stage 3 + offload, update on host, delayed"]


def _bench(*args, timeout=600):
  env = dict(os.environ, PYTHONPATH=_ROOT)
  out = subprocess.run([sys.executable, _SCRIPT, *args], env=env,
                       capture_output=True, text=True, timeout=timeout)
  assert out.returncode == 0, out.stdout + out.stderr
  return out.stdout


@functools.cache
def _dry_run(*args):
  """The runs ``--dry-run ARGS`` plans (it imports no jax), as dicts; the
  same arguments run once per file."""
  return tuple(json.loads(line) for line in _bench(
      "--dry-run", *args).splitlines())


def test_every_mode_trains_and_is_reported(tmp_path):
  # Every plan on the tiny model: the speed runs (zero_jax, plain jax.jit,
  # the torch peer), two offload modes, then the capacity ladder from its
  # next size (stage 3 is the only ladder mode chosen).
  _bench("--tiny", "--plan", "all", "--out-dir", str(tmp_path),
         "--capacity-from", "tiny2", "--modes", _ZERO, _BASELINE, _TORCH,
         *_OFFLOADS)
  results = json.loads((tmp_path / "gpu_bench.json").read_text())
  assert [r["mode"] for r in results] == [_ZERO, _BASELINE, _TORCH,
                                          *_OFFLOADS, _ZERO]
  torch = results.pop(2)
  if importlib.util.find_spec("torch") is None:
    assert torch["status"] == "skipped (torch not installed)"
  else:
    assert torch["status"] == "ok" and torch["params"] == results[0]["params"]
  for r in results:
    assert r["status"] == "ok" and r["tokens_per_s"] > 0
    # The update on the host runs the fused host optimizer and reports
    # where its time went.
    assert (r["host_update"] is not None) == ("update on host" in r["mode"])
    if r["host_update"]:
      assert "numba) on" in r["host_update"][0]
      assert "the last update: gradients to the host" in r["host_update"][0]
    assert r["compiled_device_bytes"] > 0 and len(r["losses"]) == r["steps"]
    assert r["mfu"] is None  # no known peak on CPU
    assert r["attention"] == "auto" and r["loss_chunk"] == 16
  zero, baseline = results[:2]
  # zero_jax chose the remat (a CPU device's share of the host's memory
  # holds the tiny model whole); the baseline trained at that choice.
  assert zero["remat"] == "none" == baseline["remat"]
  assert zero["remat_reason"].startswith("remat auto chose none")
  # Same model, same data, same first step: every mode starts at the same
  # loss (bf16 forward).
  first = [r["losses"][0] for r in results if not r.get("capacity")]
  assert max(first) - min(first) < 1e-2 * abs(first[0])
  md = (tmp_path / "gpu_bench.md").read_text()
  assert ("tiny: zero_jax step time / plain jax.jit at the same settings "
          "(remat none)") in md
  assert "update on host: step time / no offload" in md
  assert "update on host, delayed: step time / no offload" in md
  assert "largest model that trains, zero_jax stage 3: tiny2" in md


def test_plans():
  # --dry-run prints the plan without importing jax. The default, speed:
  # the 1.3B model first, zero_jax before the baseline that copies its
  # remat, then the torch peers.
  runs = _dry_run()
  assert [r["size"] for r in runs] == ["1.3b"] * 5 + ["125m"] * 5
  assert [r["mode"] for r in runs[:3]] == [_ZERO, _BASELINE, _TORCH]
  assert {(r["attention"], r["remat"], r["loss_chunk"], r["batch"])
          for r in runs} == {("auto", "auto", 1024, 16)}
  runs = _dry_run("--plan", "all")
  ladder = [r for r in runs if r["capacity"]]
  assert len([r for r in runs if r["plan"] == "offload"]) == 2 * 4
  assert ladder[0]["size"] == "1.3b" and ladder[-1]["size"] == "30b"


def test_opt_in_modes_run_only_when_named():
  prefetch = "zero_jax stage 3 + prefetch"
  assert prefetch not in {r["mode"] for r in _dry_run()}
  runs = _dry_run("--modes", _ZERO, prefetch)
  assert [r["mode"] for r in runs[:2]] == [_ZERO, prefetch]
  # A mode no run of the plan has is an error, not silently dropped.
  env = dict(os.environ, PYTHONPATH=_ROOT)
  out = subprocess.run([sys.executable, _SCRIPT, "--dry-run", "--plan",
                        "capacity", "--modes", prefetch], env=env,
                       capture_output=True, text=True, timeout=60)
  assert out.returncode != 0 and "no run of --plan capacity" in out.stderr
