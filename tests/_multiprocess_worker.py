"""One process of a 2-process run (see test_multiprocess.py).

Usage: python -m tests._multiprocess_worker PORT PROCESS_ID STAGE OUT.npz
Each process owns 4 CPU devices and feeds only its half of every global
batch, as process-local numpy arrays.
"""

import sys

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(port: int, pid: int, stage: int, out: str) -> None:
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2,
                             process_id=pid)
  import numpy as np
  import optax

  import zero_jax as zj
  from tests import _models as m

  assert jax.process_count() == 2 and len(jax.devices()) == 8
  engine = zj.Engine(m.mlp_loss, optax.adamw(1e-2),
                     zj.ZeroConfig(stage=stage, min_shard_elements=0),
                     zj.make_mesh())
  state = engine.init(m.mlp_params())
  losses = []
  for batch in m.mlp_batches(5):
    half = batch["x"].shape[0] // 2
    local = jax.tree.map(lambda x: x[pid * half:(pid + 1) * half], batch)
    state, metrics = engine.step(state, local)
    losses.append(float(metrics["loss"]))
  full = engine.gather_params(state)
  if pid == 0:
    np.savez(out, losses=np.array(losses),
             **{k: np.asarray(v) for k, v in full.items()})
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
