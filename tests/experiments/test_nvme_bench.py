"""experiments/nvme_bench.py at a tiny size: the NVMe tier's bandwidth
beside the raw disk's (no GPU needed).

The script is run as a user would (``--gib 0.05 --rounds 1``, two tier
settings) on a directory under pytest's temporary one, and its report is
checked: every column is there and every figure positive (speeds are the
recorded run's business, not a test's), the markdown is written, and no
file is left behind. The benchmark is not imported: tests and experiments
stay independent.
"""

import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_SCRIPT = os.path.join(_ROOT, "experiments", "nvme_bench.py")
COLUMNS = ["round", "raw read GB/s", "raw write GB/s", "tier read GB/s",
           "tier write GB/s", "read tier/raw", "write tier/raw",
           "update GB/s", "update / raw in turn", "update s"]


def _cells(line):
  return [c.strip() for c in line.strip().strip("|").split("|")]


def test_bandwidth_table_is_measured_written_and_cleaned_up(tmp_path):
  disk, out = tmp_path / "disk", tmp_path / "nvme.md"
  env = dict(os.environ, PYTHONPATH=_ROOT, JAX_PLATFORMS="cpu")
  run = subprocess.run(
      [sys.executable, _SCRIPT, "--dir", str(disk), "--gib", "0.05",
       "--rounds", "1", "--nvme", "", "--nvme",
       "in_flight=4,block_bytes=4MiB,slice_bytes=16MiB,buffer_count=3",
       "--out", str(out)],
      env=env, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stdout + run.stderr[-3000:]
  text = run.stdout
  assert out.read_text() in text
  # One table per setting: its header, a row for the round and the median.
  headers = [i for i, line in enumerate(text.splitlines())
             if line.startswith("| round |")]
  assert len(headers) == 2, text
  lines = text.splitlines()
  for h in headers:
    assert _cells(lines[h]) == COLUMNS, lines[h]
    for line, first in zip(lines[h + 2:h + 4], ("1", "median")):
      cells = _cells(line)
      assert cells[0] == first and len(cells) == len(COLUMNS), line
      assert all(float(c) > 0 for c in cells[1:]), line
  assert "(the defaults)" in text
  assert "slice 16 MiB, buffers 3" in text
  # Every setting's medians, and every raw method's.
  summary = [line for line in lines if line.startswith("| 0: ") or
             line.startswith("| 1: ")]
  assert len(summary) == 2, text
  for line in summary:
    assert all(float(c) > 0 for c in _cells(line)[1:]), line
  raw = [line for line in lines if " requests |" in line]
  assert {_cells(line)[0] for line in raw} == {
      "1 thread, 64 MiB requests", "4 in flight, 4 MiB requests",
      "8 in flight, 4 MiB requests", "8 in flight, 8 MiB requests",
      "16 in flight, 8 MiB requests"}, raw
  assert "--gib 0.05 --rounds 1" in text  # (the command, in the report)
  # The raw file and both tiers' files deleted.
  assert list(disk.iterdir()) == []
