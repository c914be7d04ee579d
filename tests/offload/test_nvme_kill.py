"""The NVMe tier's crash consistency: a process killed (SIGKILL) anywhere in
a step leaves the last committed state whole, and a restart with
``NvmeOptions(resume=True)`` resumes it and trains on bit for bit as a
run that never crashed; a flipped byte in a committed file is an error
naming the file and the step.

The killed processes and the restarts run in processes of their own
(``tests/offload/_nvme_kill_worker.py``): five killed at five points of
one step, then one that runs the uncrashed reference and the five
restarts, its engines sharing their compiled programs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests import _models as m
from tests.offload import _nvme_kill_worker as w
from zero_jax.offload import _nvme
from zero_jax.offload import DiskError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
TIME_LIMIT_S = 240  # per process (about 3 s each on 2 cores, warm)


def _worker(*args: str) -> subprocess.CompletedProcess:
  # (With the run's XLA_FLAGS and compilation cache: tests/conftest.py.)
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  try:
    return subprocess.run(
        [sys.executable, "-m", "tests.offload._nvme_kill_worker", *args],
        cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=TIME_LIMIT_S)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"the NVMe kill worker {args} did not end within "
                f"{TIME_LIMIT_S} s: {(e.stdout or b'')[-3000:]!r}")


def test_killed_anywhere_in_a_step_resumes_the_last_commit(tmp_path):
  """SIGKILL during a read of the step's update, during the update (some
  slices updated, some maybe written), during a write, after every write
  but before the manifest, and right after the manifest: the restart
  resumes the step before the killed one (the step after it, once its
  manifest is written) and ends as the uncrashed run, bit for bit."""
  k = w.KILLED_AT
  dirs = {p: tmp_path / p for p in w.POINTS}
  for point, path in dirs.items():
    proc = _worker("kill", point, str(path))
    log = (proc.stdout + proc.stderr)[-5000:]
    # (-9: the armed hook fired; 3 would say the step ran to its end.)
    assert proc.returncode == -9, (point, proc.returncode, log)
    record = _nvme.read_manifest(path / "process-0")
    assert record is not None, point
    assert record["step"] == (k + 1 if point == "committed" else k), (
        point, record["step"])

  out = tmp_path / "out"
  out.mkdir()
  proc = _worker("resume", str(out), str(tmp_path / "reference"),
                 *(f"{p}={d}" for p, d in dirs.items()))
  log = (proc.stdout + proc.stderr)[-5000:]
  assert proc.returncode == 0 and "DONE" in proc.stdout, log
  with open(out / "results.json", encoding="utf-8") as f:
    results = json.load(f)
  ref = results["reference"]
  assert ref["first"] == 0 and ref["step"] == w.STEPS
  ref_params = dict(np.load(out / "reference.npz"))
  for point in w.POINTS:
    got = results[point]
    first = k + 1 if point == "committed" else k
    assert got["first"] == first, (point, got["first"])
    assert got["step"] == w.STEPS, point
    assert got["losses"] == ref["losses"][first:], point
    params = dict(np.load(out / f"{point}.npz"))
    assert params.keys() == ref_params.keys(), point
    for name, x in params.items():
      np.testing.assert_array_equal(x, ref_params[name],
                                    err_msg=f"{point}: {name}")


def test_a_flipped_byte_in_the_committed_state_is_an_error(tmp_path):
  """A byte of the committed master changed on disk: the restart's first
  read (the compute copy, cast in ``engine.init``) raises ``DiskError``
  naming the file and the committed step."""
  engine = w.engine(str(tmp_path))
  state = engine.init(m.mlp_params())
  for b in m.mlp_batches(2):
    state, _ = engine.step(state, b)
  assert int(state.step) == 2
  plan = engine.layout.update.host.plan
  assert len(plan.slices) >= w.MIN_SLICES
  root = tmp_path / "process-0"
  record = _nvme.read_manifest(root)
  assert record["step"] == 2
  engine.layout.update.host.close()  # (its files and I/O threads)
  path = root / f"master.{record['version']}"
  # (Inside the third slice, in the middle of a leaf's values.)
  at = plan.slices[2].start * 4 + 13
  with open(path, "r+b") as f:
    f.seek(at)
    byte = f.read(1)[0]
    f.seek(at)
    f.write(bytes([byte ^ 0x20]))

  with pytest.raises(DiskError) as e:
    w.engine(str(tmp_path)).init(m.mlp_params())
  message = str(e.value)
  assert str(path) in message and "step 2" in message, message
