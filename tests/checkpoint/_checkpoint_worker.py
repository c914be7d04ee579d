"""A separate process for the checkpoint tests (see test_checkpoint.py).

Usage: python -m tests.checkpoint._checkpoint_worker DEVICES MODE ARGS...

- ``resume SPEC.json OUT.npz``: for each job of the spec (a checkpoint
  directory, a stage and config overrides), restore the checkpoint on this
  process's DEVICES devices, train the 5 remaining steps, and write the
  losses and gathered parameters.
- ``kill_during_save DIR``: save step 1, then start an asynchronous save of
  step 2 whose commit stalls (a slow file system), print ``SAVING`` and wait
  to be killed.
- ``sigterm DIR``: train until SIGTERM, then save a final checkpoint, print
  ``PREEMPTED AT <step>`` and exit with 143.
"""

import os
import sys

DEVICES = int(sys.argv[1])
os.environ["XLA_FLAGS"] = (
    f"--xla_force_host_platform_device_count={DEVICES}")
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402
from tests import _models as m  # noqa: E402

TX = optax.adamw(1e-2)
BATCHES = m.mlp_batches(10)


def engine(stage: int, **overrides) -> zj.Engine:
  config = zj.ZeroConfig(stage=stage, min_shard_elements=0, **overrides)
  return zj.Engine(m.mlp_loss, TX, config, zj.make_mesh())


def resume(spec: str, out: str) -> None:
  results = {}
  for i, job in enumerate(json.load(open(spec))):
    eng = engine(job["stage"], **job["config"])
    with zj.Checkpointer(job["dir"]) as ckpt:
      state = ckpt.restore(eng, m.mlp_params())
    assert int(state.step) == 5
    state, losses = m.run_steps(eng, state, BATCHES[5:])
    results[f"{i}/losses"] = np.array(losses)
    for k, v in eng.gather_params(state).items():
      results[f"{i}/{k}"] = np.asarray(v)
  np.savez(out, **results)


def kill_during_save(directory: str) -> None:
  # (Fault injection: orbax's commit step, stalled.)
  # pylint: disable=g-import-not-at-top
  import asyncio
  from orbax.checkpoint._src.path import atomicity

  eng = engine(3)
  state, _ = m.run_steps(eng, eng.init(m.mlp_params()), BATCHES[:1])
  ckpt = zj.Checkpointer(directory)
  ckpt.save(state)
  ckpt.wait()
  finalize = atomicity.AtomicRenameTemporaryPath.finalize

  async def stalled(self, *args, **kwargs):
    await asyncio.sleep(600)  # the data is written; the commit never comes
    return await finalize(self, *args, **kwargs)

  atomicity.AtomicRenameTemporaryPath.finalize = stalled
  state, _ = m.run_steps(eng, state, BATCHES[1:2])
  ckpt.save(state)  # returns; the write goes on in the background
  print("SAVING", flush=True)
  ckpt.wait()


def sigterm(directory: str) -> None:
  eng = engine(2)
  ckpt = zj.Checkpointer(directory, max_to_keep=2)
  state = eng.init(m.mlp_params())
  rng = np.random.default_rng(1)
  step = 0
  while True:
    batch = {"x": rng.normal(size=(32, 16)).astype(np.float32),
             "y": rng.normal(size=(32, 8)).astype(np.float32)}
    state, _ = eng.step(state, batch)
    step = int(state.step)
    print(f"step {step}", flush=True)
    if step % 4 == 0 or ckpt.reached_preemption(step):
      ckpt.save(state, engine=eng)
    if ckpt.reached_preemption(step):
      ckpt.close()
      print(f"PREEMPTED AT {step}", flush=True)
      sys.exit(143)


if __name__ == "__main__":
  assert len(jax.devices()) == DEVICES
  {"resume": resume, "kill_during_save": kill_during_save,
   "sigterm": sigterm}[sys.argv[2]](*sys.argv[3:])
