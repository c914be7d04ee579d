"""ZeRO with tensor parallelism across processes: a 2-process launcher run
on (data 4, model 2), 2 data x 2 model ranks per process, equals one
process and single-device optax."""

import os
import subprocess
import sys

import jax
import numpy as np
import optax

import zero_jax as zj
from tests import _models as m
from tests import _tp_models as tpm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "distributed", "_tp_worker.py")
STEPS = 3
# The worker's (the script initializes JAX's distributed runtime as it is
# imported, so it is not imported here).
TX = optax.adamw(1e-2, weight_decay=0.1)


def test_two_processes_on_data_x_model_match_one(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "zero_jax.launch", "--nproc", "2",
       "--devices-per-proc", "4", SCRIPT, str(tmp_path), str(STEPS)],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
  assert "[0] process 0 done" in proc.stdout, proc.stdout[-3000:]
  assert "[1] process 1 done" in proc.stdout, proc.stdout[-3000:]
  result = np.load(tmp_path / "result.npz")
  # Each process fed its half of every global batch of 16.
  np.testing.assert_array_equal(result["rows"], [8] * STEPS)

  batches = tpm.tp_batches(STEPS)
  ref_losses, ref_params = m.train_reference(tpm.nnx_loss, TX,
                                             tpm.nnx_init(), batches)
  # The same engine in this one process, on its 8 devices.
  engine = zj.Engine(tpm.nnx_loss, TX,
                     zj.ZeroConfig(stage=3, min_shard_elements=0),
                     zj.make_mesh(model=2))
  losses, params, _ = m.train_engine(engine, tpm.nnx_init(), batches)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  assert list(result["paths"]) == [jax.tree_util.keystr(p) for p, _ in flat]
  got = jax.tree.unflatten(jax.tree.structure(params),
                           [result[f"param/{i}"] for i in range(len(flat))])
  got_losses = list(result["losses"])
  m.assert_matches(got_losses, got, losses, params, tol=1e-6)
  m.assert_matches(got_losses, got, ref_losses, ref_params)
