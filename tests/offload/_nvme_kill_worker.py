"""A process for the NVMe tier's kill tests (see test_nvme_kill.py).

Usage:
  python -m tests.offload._nvme_kill_worker kill POINT DIR
  python -m tests.offload._nvme_kill_worker resume OUT REF_DIR [POINT=DIR ...]

``kill``: trains the MLP (``tests/_models.py``) with the NVMe tier in DIR
(``NvmeOptions(resume=True)``, so a fresh run in an empty DIR) for
``KILLED_AT`` steps, then arms POINT (one of ``POINTS``) and runs the
step from ``state.step == KILLED_AT``: the armed hook sends this process
SIGKILL at that point of the step. A step that returns (the hook never
fired) prints "NOT KILLED" and exits with 3, so the test sees a return
code other than -9.

``resume``: one process for all the restarts, so that the engines share
their compiled programs: an uncrashed run in REF_DIR over all ``STEPS``
batches, then, for each POINT=DIR, a new engine that resumes DIR's
committed state and trains on to the end with the same batches. Writes
``OUT/results.json`` (per run: the step it started from and the losses of
the steps it ran) and ``OUT/<run>.npz`` (the gathered parameters).
"""

from __future__ import annotations

import os
import sys

# 8 devices, with the flags of the test run's own compiler
# (tests/conftest.py) where it started this process: the same compiles, as
# quick, and the programs the run has compiled already are read back from
# its compilation cache.
if "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import zero_jax as zj  # noqa: E402
from tests import _models as m  # noqa: E402
from zero_jax import offload  # noqa: E402
from zero_jax.offload import _disk, _kernels, _nvme  # noqa: E402

STEPS = 5
KILLED_AT = 2  # the killed step goes from state.step 2 to 3
# 1024 elements a slice (12 bytes each: master and Adam's two moments, 4
# KiB of each), the smallest slice: the MLP's 5,696 parameters (its leaves
# padded to whole 4 KiB blocks) make several slices, so that each point
# below falls inside the step's pass, some slices done and some not.
SLICE_BYTES = 1024 * 12
MIN_SLICES = 3
POINTS = ("read", "update", "write", "manifest", "committed")


def engine(path: str) -> zj.Engine:
  return zj.Engine(
      m.mlp_loss, offload.adamw(1e-2, weight_decay=0.1),
      zj.ZeroConfig(stage=3, offload_optimizer="nvme", nvme_path=path,
                    update_on="host", compute_dtype="bfloat16",
                    clip_grad_norm=0.5, min_shard_elements=0,
                    nvme=zj.NvmeOptions(slice_bytes=SLICE_BYTES,
                                        buffer_count=3, resume=True)),
      zj.make_mesh(num_devices=8))


def _die() -> None:
  # (From an I/O thread too: the signal ends the whole process.)
  sys.stdout.flush()
  os.kill(os.getpid(), signal.SIGKILL)


def _on_call(module, name: str, nth: int, after: bool = False) -> None:
  """Replaces ``module.name`` with a wrapper that kills this process on
  its ``nth`` call (before the original runs; ``after``: once it has
  returned)."""
  original = getattr(module, name)
  lock, calls = threading.Lock(), [0]

  def wrapper(*args, **kwargs):
    with lock:
      calls[0] += 1
      fire = calls[0] == nth
    if fire and not after:
      _die()
    out = original(*args, **kwargs)
    if fire and after:
      _die()
    return out

  setattr(module, name, wrapper)


def arm(point: str) -> None:
  if point == "read":
    _on_call(_disk.File, "read", 2)
  elif point == "update":
    _on_call(_kernels, "apply", 2)
  elif point == "write":
    _on_call(_disk.File, "write", 2)
  elif point == "manifest":
    _on_call(_nvme, "write_manifest", 1)
  elif point == "committed":
    _on_call(_nvme, "write_manifest", 1, after=True)
  else:
    raise ValueError(f"unknown point {point!r}; one of {POINTS}")


def kill(point: str, path: str) -> None:
  batches = m.mlp_batches(STEPS)
  e = engine(path)
  state = e.init(m.mlp_params())
  slices = len(e.layout.update.host.plan.slices)
  if slices < MIN_SLICES:
    print(f"ONLY {slices} SLICE(S)")
    sys.exit(4)
  assert int(state.step) == 0, int(state.step)
  for b in batches[:KILLED_AT]:
    state, _ = e.step(state, b)
  assert int(state.step) == KILLED_AT, int(state.step)
  arm(point)
  e.step(state, batches[KILLED_AT])
  print("NOT KILLED")
  sys.exit(3)


def resume(out: str, ref: str, runs: list[str]) -> None:
  batches = m.mlp_batches(STEPS)
  results = {}

  def train(name: str, path: str) -> None:
    e = engine(path)
    state = e.init(m.mlp_params())
    first = int(state.step)
    state, losses = m.run_steps(e, state, batches[first:])
    results[name] = {"first": first, "losses": losses,
                     "step": int(state.step)}
    params = jax.tree_util.tree_flatten_with_path(e.gather_params(state))[0]
    np.savez(os.path.join(out, f"{name}.npz"),
             **{jax.tree_util.keystr(k): np.asarray(v) for k, v in params})
    e.layout.update.host.close()

  train("reference", ref)
  for run in runs:
    point, path = run.split("=", 1)
    train(point, path)
  with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
    json.dump(results, f)
  print("DONE")


if __name__ == "__main__":
  if sys.argv[1] == "kill":
    kill(sys.argv[2], sys.argv[3])
  else:
    resume(sys.argv[2], sys.argv[3], sys.argv[4:])
