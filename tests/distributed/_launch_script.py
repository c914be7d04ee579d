"""One process of a multi-process run (see test_distributed.py).

Usage, from the repository root::

  python -m zero_jax.launch --nproc 2 --devices-per-proc 4 \\
      tests/distributed/_launch_script.py train OUT_DIR
  # train until killed or SIGTERM:
  ... tests/distributed/_launch_script.py loop OUT_DIR
  # process 1 raises at once:
  ... tests/distributed/_launch_script.py raise
  # two steps, then process 1 feeds 4 rows at the third, process 0 8:
  ... tests/distributed/_launch_script.py rows

``train`` trains the MLP of tests/_models.py for 5 steps at every ZeRO stage,
and at stage 3 on a 2-D mesh whose replica groups are the two processes,
then the NNX model of tests/_tp_models.py for 3 steps at stage 3 with
tensor parallelism on ``make_mesh(model=2)``, (data 4, model 2): each
process holds 2 data ranks x 2 model ranks; then a masked mean of global
meaning over two micro-batches at stage 3 (one run pays the process
start-up once). Each process feeds only its rows of every global batch.
Process 0 writes ``OUT_DIR/result.npz``: per MLP run (see ``RUNS``)
``{run}/losses`` and ``{run}/{param}`` (the gathered parameters), plus
whatever ``after_training`` returns; for the tensor-parallel run
``tp/losses``, ``tp/param/{i}`` (the gathered parameters, flattened),
``tp/paths`` (their key paths) and ``tp/rows`` (the rows each step fed
here); for the global loss ``global/losses`` and ``global/{param}``. The MLP's stage 3 runs also save a checkpoint,
``OUT_DIR/ckpt_{run}``. Each process then prints ``process {i} done`` and
goes on with ``rows`` (below), whose last step fails the job by design.

``rows`` (alone, or after ``train``): two steps on each process's rows of
the same global batches, the time of the batch check alone, then a step
where process 1 feeds 4 rows and process 0 8, which both must refuse.
"""

from __future__ import annotations

import os
import sys
import time

# Run as a script, this file's directory is on sys.path, not the root that
# holds the tests package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from zero_jax import distributed  # noqa: E402

# First, before anything touches devices (tests._models creates arrays at
# import time); twice, to check that a second call is a no-op. ("loop" is
# killed by the tests: a short heartbeat timeout ends its survivor sooner.)
_HEARTBEAT = dict(heartbeat_timeout_seconds=10) if sys.argv[1] == "loop" else {}
distributed.initialize(**_HEARTBEAT)
distributed.initialize(**_HEARTBEAT)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402
from tests import _models as m  # noqa: E402
from zero_jax.train import _agreement  # noqa: E402
from zero_jax.layout import DATA, MODEL  # noqa: E402

# name: (stage, replica groups).
RUNS = {"s0": (0, 1), "s1": (1, 1), "s2": (2, 1), "s3": (3, 1),
        "r2s3": (3, 2)}
STEPS = 5
# The tensor-parallel run's steps and optimizer (test_distributed.py trains
# the same in one process).
TP_STEPS = 3
TP_TX = optax.adamw(1e-2, weight_decay=0.1)
# Rounds of the batch check alone that "rows" times.
CHECK_ROUNDS = 200


def make_engine(stage: int, replica: int = 1) -> zj.Engine:
  return zj.Engine(m.mlp_loss, optax.adamw(1e-2),
                   zj.ZeroConfig(stage=stage, min_shard_elements=0),
                   zj.make_mesh(replica=replica))


def after_training(run: str, engine: zj.Engine, state: zj.TrainState,
                   out_dir: str) -> dict[str, np.ndarray]:
  """Saves the stage 3 runs' states; the test restores them in one process.

  Returns arrays for process 0 to add to result.npz (keys are prefixed with
  ``{run}/``).
  """
  if run in ("s3", "r2s3"):
    # Each process writes the shards its devices hold.
    with zj.Checkpointer(os.path.join(out_dir, f"ckpt_{run}")) as ckpt:
      ckpt.save(state, engine=engine)
  return {}


def train(out_dir: str) -> None:
  assert jax.process_count() == 2, jax.process_count()
  assert len(jax.devices()) == 8 and len(jax.local_devices()) == 4
  result: dict[str, np.ndarray] = {}
  for run, (stage, replica) in RUNS.items():
    engine = make_engine(stage, replica)
    trained, state = train_mlp(engine)
    result.update({f"{run}/{k}": v for k, v in trained.items()})
    for k, v in after_training(run, engine, state, out_dir).items():
      result[f"{run}/{k}"] = np.asarray(v)
  result.update({f"tp/{k}": v for k, v in train_tp().items()})
  result.update({f"global/{k}": v for k, v in train_global().items()})
  if distributed.is_main_process():
    np.savez(os.path.join(out_dir, "result.npz"), **result)
  print(f"process {jax.process_index()} done", flush=True)
  # (One start-up for both: test_distributed.py checks each.)
  rows()


def train_tp() -> dict[str, np.ndarray]:
  """Stage 3 on (data 4, model 2) over both processes' devices: the losses,
  the rows fed here, and the gathered parameters (flattened, with their
  key paths)."""
  # (Here: flax, which the other modes do not need.)
  from tests import _tp_models as tpm  # pylint: disable=g-import-not-at-top
  engine = zj.Engine(tpm.nnx_loss, TP_TX,
                     zj.ZeroConfig(stage=3, min_shard_elements=0),
                     zj.make_mesh(model=2))
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
  for batch in tpm.tp_batches(TP_STEPS):
    local = distributed.local_batch(batch, mesh)
    fed.append(local["tokens"].shape[0])
    state, metrics = engine.step(state, local)
    losses.append(float(metrics["loss"]))
  flat = jax.tree_util.tree_flatten_with_path(engine.gather_params(state))[0]
  result = {"losses": np.array(losses), "rows": np.array(fed),
            "paths": np.array([jax.tree_util.keystr(p) for p, _ in flat])}
  for i, (_, v) in enumerate(flat):
    result[f"param/{i}"] = np.asarray(v)
  return result


def global_engine() -> zj.Engine:
  """A loss of global meaning over two micro-batches, weighed by their
  counts (test_distributed.py trains the same in one process)."""
  return zj.Engine(m.mlp_masked_loss, optax.adamw(1e-2),
                   zj.ZeroConfig(stage=3, min_shard_elements=0,
                                 loss_scope="global", grad_accum_steps=2),
                   zj.make_mesh(), loss_weight=m.mlp_masked_count)


def train_mlp(engine: zj.Engine) -> tuple[dict[str, np.ndarray],
                                          zj.TrainState]:
  """The MLP trained by ``engine`` for STEPS steps on this process's rows:
  ``({"losses": ..., param: gathered}, final state)``."""
  state = engine.init(m.mlp_params())
  losses = []
  for batch in m.mlp_batches(STEPS):
    state, metrics = engine.step(state,
                                 distributed.local_batch(batch, engine.mesh))
    losses.append(float(metrics["loss"]))
  result = {"losses": np.array(losses)}
  for k, v in engine.gather_params(state).items():
    result[k] = np.asarray(v)
  return result, state


def train_global() -> dict[str, np.ndarray]:
  """``global_engine`` trained by ``train_mlp`` (its first step checks the
  split across both processes)."""
  return train_mlp(global_engine())[0]


def loop(out_dir: str) -> None:
  """Trains until killed, or until SIGTERM: then saves a checkpoint at the
  step JAX's preemption service picks for both processes, and exits 143.
  Writes ``ready{i}`` once it has taken a step."""
  engine = make_engine(3)
  state = engine.init(m.mlp_params())
  batch = distributed.local_batch(m.mlp_batches(1)[0], engine.mesh)
  ckpt = zj.Checkpointer(os.path.join(out_dir, "ckpt"))
  step = 0
  while True:
    state, metrics = engine.step(state, batch)
    float(metrics["loss"])  # wait for the step (and its collectives)
    step += 1
    if step == 2:
      path = os.path.join(out_dir, f"ready{jax.process_index()}")
      with open(path, "w") as f:
        f.write(str(os.getpid()))
    if ckpt.reached_preemption(step):
      ckpt.save(state)
      ckpt.close()
      print(f"preempted at step {step}", flush=True)
      sys.exit(143)


def fail() -> None:
  """Process 1 raises; process 0 waits in host code, outside collectives,
  where only fail_fast can stop it quickly."""
  if jax.process_index() == 1:
    raise ValueError("deliberate failure")
  time.sleep(120)


def rows() -> None:
  """Two steps on each process's rows of the same global batches; the time
  of the batch check alone (what every step adds); then a last step where
  process 1 feeds 4 rows and process 0 8, which both must refuse."""
  engine = make_engine(3)
  state = engine.init(m.mlp_params())
  batches = [distributed.local_batch(b, engine.mesh)
             for b in m.mlp_batches(3, batch=16)]
  for batch in batches[:2]:
    state, metrics = engine.step(state, batch)
  print(f"process {jax.process_index()} took 2 steps, loss "
        f"{float(metrics['loss']):.4f}", flush=True)
  t0 = time.perf_counter()
  for _ in range(CHECK_ROUNDS):
    _agreement.check_batch(batches[0], jax.process_count())
  per_round = (time.perf_counter() - t0) / CHECK_ROUNDS
  print(f"process {jax.process_index()}: the batch check costs "
        f"{per_round * 1e3:.2f} ms per step", flush=True)
  last = batches[2]
  if jax.process_index() == 1:
    last = {k: v[:4] for k, v in last.items()}
  engine.step(state, last)
  print(f"process {jax.process_index()} trained on disagreeing batches",
        flush=True)


if __name__ == "__main__":
  mode = sys.argv[1]
  if mode == "train":
    train(sys.argv[2])
  elif mode == "loop":
    loop(sys.argv[2])
  elif mode == "raise":
    fail()
  elif mode == "rows":
    rows()
  else:
    raise SystemExit(f"unknown mode {mode!r}")
