"""One process of a 2-process tensor-parallel run (see
test_tp_multiprocess.py).

Usage, from the repository root::

  python -m zero_jax.launch --nproc 2 --devices-per-proc 4 \\
      tests/distributed/_tp_worker.py OUT_DIR STEPS

Trains the NNX model of tests/_tp_models.py at stage 3 on
``make_mesh(model=2)`` over the 8 devices of both processes, (data 4,
model 2): each process holds 2 data ranks x 2 model ranks, and feeds only
its rows of every global batch. Process 0 writes ``OUT_DIR/result.npz``:
``losses``, ``param/{i}`` (the gathered parameters, flattened) and
``paths`` (their key paths), and ``rows`` (the rows each step fed here).
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's directory is on sys.path, not the root that
# holds the tests package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from zero_jax import distributed  # noqa: E402

# Before anything touches devices.
distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402
from tests import _tp_models as tpm  # noqa: E402
from zero_jax.layout import DATA, MODEL  # noqa: E402

# (test_tp_multiprocess.py trains the same in one process.)
TX = optax.adamw(1e-2, weight_decay=0.1)


def make_engine() -> zj.Engine:
  """Stage 3 on (data 4, model 2) over both processes' devices."""
  return zj.Engine(tpm.nnx_loss, TX,
                   zj.ZeroConfig(stage=3, min_shard_elements=0),
                   zj.make_mesh(model=2))


def train(out_dir: str, steps: int) -> None:
  assert jax.process_count() == 2, jax.process_count()
  assert len(jax.devices()) == 8 and len(jax.local_devices()) == 4
  engine = make_engine()
  mesh = engine.mesh
  assert dict(mesh.shape) == {DATA: 4, MODEL: 2}, mesh.shape
  # Model innermost: this process's 4 devices are 2 whole data ranks (rows
  # of the mesh) x the 2 model ranks.
  me = jax.process_index()
  rows = mesh.devices[2 * me:2 * me + 2]
  assert {d.process_index for d in rows.flat} == {me}, mesh.devices
  state = engine.init(tpm.nnx_init())
  # ZeRO over 'data' and the model's own split over 'model', both real.
  specs = [str(x.sharding.spec) for x in jax.tree.leaves(state.params)]
  assert any(DATA in s and MODEL in s for s in specs), specs
  losses, fed = [], []
  for batch in tpm.tp_batches(steps):
    local = distributed.local_batch(batch, mesh)
    fed.append(local["tokens"].shape[0])
    state, metrics = engine.step(state, local)
    losses.append(float(metrics["loss"]))
  flat = jax.tree_util.tree_flatten_with_path(engine.gather_params(state))[0]
  result = {"losses": np.array(losses), "rows": np.array(fed),
            "paths": np.array([jax.tree_util.keystr(p) for p, _ in flat])}
  for i, (_, v) in enumerate(flat):
    result[f"param/{i}"] = np.asarray(v)
  if distributed.is_main_process():
    np.savez(os.path.join(out_dir, "result.npz"), **result)
  print(f"process {me} done", flush=True)


if __name__ == "__main__":
  train(sys.argv[1], int(sys.argv[2]))
