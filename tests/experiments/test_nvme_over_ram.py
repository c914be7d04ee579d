"""experiments/nvme_over_ram.py at a tiny size: the run completes, the twin
trains alike on both tiers, and the report holds its figures (the recorded
run is the 2.3B one in experiments/results/nvme_over_ram_cpu.md)."""

import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def test_over_ram_run_reports_rss_bandwidth_and_the_twin(tmp_path):
  out = tmp_path / "report.md"
  run = subprocess.run(
      [sys.executable, os.path.join(_ROOT, "experiments", "nvme_over_ram.py"),
       "--nvme-path", str(tmp_path / "nvme"), "--params-b", "0.004",
       "--twin-params-b", "0.002", "--steps", "2", "--slice-mib", "4",
       "--out", str(out)],
      env=dict(os.environ, PYTHONPATH=_ROOT, JAX_PLATFORMS="cpu"),
      capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stdout + run.stderr[-3000:]
  text = out.read_text()
  for row in ("| peak RSS |", "| last update's pass |", "GB/s read",
              "losses equal on the host and NVMe tiers",
              "--params-b 0.004"):
    assert row in text, text
  assert "--out" not in text
