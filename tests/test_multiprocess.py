"""Two real processes (4 CPU devices each, gloo) match single-device optax."""

import os
import socket
import subprocess
import sys

import numpy as np
import optax
import pytest

from tests import _models as m

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.parametrize("stage", [1, 3])
def test_two_processes_with_process_local_batches(stage, tmp_path):
  out = tmp_path / "result.npz"
  port = _free_port()
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)  # each worker sets its own device count
  procs = [subprocess.Popen(
      [sys.executable, "-m", "tests._multiprocess_worker", str(port),
       str(pid), str(stage), str(out)], cwd=ROOT, env=env,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for pid in range(2)]
  logs = []
  for p in procs:
    try:
      logs.append(p.communicate(timeout=240)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]

  result = np.load(out)
  ref_losses, ref_params = m.train_reference(m.mlp_loss, optax.adamw(1e-2),
                                             m.mlp_params(),
                                             m.mlp_batches(5))
  params = {k: result[k] for k in ref_params}
  m.assert_matches(list(result["losses"]), params, ref_losses, ref_params)
