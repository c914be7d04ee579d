"""One process of a 2-process run of the host update (see
test_host_update_multiprocess.py).

Usage, from the repository root::

  python -m zero_jax.launch --nproc 2 --devices-per-proc 8 \\
      tests/distributed/_host_update_worker.py OUT_DIR

Trains the MLP of tests/_models.py with ``update_on="host"`` in each
configuration of ``CASES``, on a mesh of all 16 devices of both processes
(each device its own host partner), of 4 per process (the other 4 are
their partners, one each) or of 2 per process (4 of the other 6 are
their partners, 2 each), feeding only this process's rows of every global
batch. Process 0 writes ``OUT_DIR/<case>.npz``: ``losses`` and
``param/<name>`` (the gathered parameters). The cases in ``SAVED`` also
save a checkpoint, restore it into a new engine and check that one more
step from each gives the same loss and parameters, and export the
parameters to ``OUT_DIR/export_<case>`` (every process its shards).
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

import zero_jax as zj  # noqa: E402
from tests import _models as m  # noqa: E402
from tests.distributed._host_update_cases import (  # noqa: E402
    CASES, SAVED, STEPS, make_tx)

# Each device's partners: the others of its process, shared out (a power
# of two of them: 6 free for 2 devices gives 2 each).
PARTNERS = {2: 2, 4: 1, 8: 1}



def config(fields: dict) -> zj.ZeroConfig:
  return zj.ZeroConfig(offload_optimizer="host", update_on="host",
                       min_shard_elements=0, **fields)


def mesh_devices(per_process: int) -> list:
  """The first ``per_process`` devices of each process."""
  return [d for proc in range(jax.process_count())
          for d in sorted((d for d in jax.devices()
                           if d.process_index == proc),
                          key=lambda d: d.id)[:per_process]]


def train(out_dir: str) -> None:
  assert jax.process_count() == 2, jax.process_count()
  me = jax.process_index()
  for name, (opt, per_process, fields) in CASES.items():
    mesh = zj.make_mesh(devices=mesh_devices(per_process))
    engine = zj.Engine(m.mlp_loss, make_tx(opt), config(fields),
                       mesh)
    state = engine.init(m.mlp_params())
    # Each device's shards on CPU devices of its own process, split among
    # them: the mesh's devices themselves, or the others.
    c = PARTNERS[per_process]
    for x in jax.tree.leaves((state.params, state.opt_state)):
      host = x.sharding.mesh.devices
      assert host.shape == (*mesh.devices.shape, c), (host.shape, name)
      for d, hs in zip(mesh.devices.flat, host.reshape(-1, c)):
        assert {h.process_index for h in hs} == {d.process_index}, name
        assert (list(hs) == [d]) == (per_process == 8), name
    if c > 1:
      # (A device's block of w2 divides between its 2 partners.)
      assert "host" in str(state.params["w2"].sharding.spec), name
    assert "in 2 processes" in engine.describe(), engine.describe()
    assert ("numba) on" in engine.describe()) == (
        opt.startswith("fused_")), engine.describe()
    losses = []
    for batch in m.mlp_batches(STEPS):
      state, metrics = engine.step(state,
                                   distributed.local_batch(batch, mesh))
      losses.append(float(metrics["loss"]))
    params = engine.gather_params(state)
    if distributed.is_main_process():
      np.savez(os.path.join(out_dir, f"{name}.npz"), losses=np.array(losses),
               **{f"param/{k}": np.asarray(v) for k, v in params.items()})
    if name in SAVED:
      # (Last: the state it steps from is donated.)
      check_restore(name, engine, make_tx(opt), state, out_dir)
    print(f"process {me} {name} done", flush=True)


def check_restore(name: str, engine: zj.Engine, tx, state,
                  out_dir: str) -> None:
  """Save, restore into a new engine, one more step from each: the same."""
  with zj.Checkpointer(os.path.join(out_dir, f"ckpt_{name}")) as ckpt:
    ckpt.save(state, engine=engine)
  again = zj.Engine(m.mlp_loss, tx, engine.config, engine.mesh)
  restored = zj.Checkpointer(os.path.join(out_dir, f"ckpt_{name}")).restore(
      again, m.mlp_params())
  batch = distributed.local_batch(m.mlp_batches(STEPS + 1)[-1], engine.mesh)
  ahead, metrics = engine.step(state, batch)
  restored, restored_metrics = again.step(restored, batch)
  assert float(metrics["loss"]) == float(restored_metrics["loss"]), name
  for x, y in zip(jax.tree.leaves(engine.gather_params(ahead)),
                  jax.tree.leaves(again.gather_params(restored))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  zj.export_params(again, restored, os.path.join(out_dir, f"export_{name}"))


if __name__ == "__main__":
  train(sys.argv[1])
