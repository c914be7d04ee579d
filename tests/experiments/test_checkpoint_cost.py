"""The checksum-cost benchmark runs and reports a cost for save and
restore (the figure itself is recorded in experiments/results/)."""

import os
import re
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def test_the_checksum_cost_is_measured_and_written(tmp_path):
  env = dict(os.environ, PYTHONPATH=_ROOT)
  out = subprocess.run(
      [sys.executable, os.path.join(_ROOT, "experiments", "checkpoint_cost.py"),
       "--repeats", "1", "--out-dir", str(tmp_path)],
      env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout + out.stderr[-3000:]
  table = (tmp_path / "checkpoint_checksum_cpu.md").read_text()
  for row in ("save (started and committed)", "restore (read and verified)"):
    match = re.search(re.escape(row) + r" \| ([\d.]+) \| ([\d.]+) \| "
                      r"([\d.]+)% \|", table)
    assert match, table
    total, checksum, cost = map(float, match.groups())
    assert 0 < checksum < total and cost > 0, table
