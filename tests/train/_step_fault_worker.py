"""A process for the step fault tests (see test_step_faults.py).

Usage: python -m tests.train._step_fault_worker OUT_DIR [SCENARIO ...]

Runs each scenario below (or those named) on the MLP with adamw
(``tests/_models.py``), making steps fail at run time on purpose, and
writes what happened to ``OUT_DIR/results.json``: per scenario, the errors
raised (type, whether a ``jax.errors.JaxRuntimeError``, message, the type
of its cause) and the losses of the training that followed; the parameters
each training ended with go to ``OUT_DIR/<run>.npz``, for the test to
compare with single-device optax. A scenario that raises records
``crash``; the others still run.

The faults, both deterministic and fast on CPU:

- out of memory: a batch of 8 rows per device makes the loss build a
  2**46-element array (or the optimizer does, on the host); its
  allocation fails at run time on every device (before any collective,
  so no device waits on another);
- a host callback that raises: on one device (no collectives, which a
  device whose callback raised would leave the others waiting on).
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
import traceback  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zero_jax as zj  # noqa: E402
from tests import _models as m  # noqa: E402
from zero_jax.checkpoint import _last_checkpoint  # noqa: E402

BAD_ROWS_PER_DEVICE = 8  # the batch that runs out of memory
POISON = 1e7  # an input the callback refuses


def _oom_loss(params, batch):
  loss = m.mlp_loss(params, batch)
  if batch["x"].shape[0] == BAD_ROWS_PER_DEVICE:
    loss = loss + _huge(loss)  # (traced for that batch only)
  return loss


def _huge(x: Any) -> jax.Array:
  """0, from an array of 2**46 floats (256 TiB, which no malloc grants)
  that depends on ``x``, and whose gradient flows back to it, so that
  nothing is folded away. (Not a sort: the gradient of a sort this size
  crashes jax 0.12's compiler.)"""
  n = jnp.arange(2 ** 23, dtype=jnp.float32)
  big = jnp.cumsum(jnp.sin(n[:, None] * x + n[None, :]), axis=-1)
  return 0 * jnp.sum(big[:, -1])


def _huge_update() -> optax.GradientTransformation:
  """An optax transformation whose update runs out of memory."""

  def update(updates, state, params=None):
    del params
    total = sum(jnp.sum(u) for u in jax.tree.leaves(updates))
    return jax.tree.map(lambda u: u + _huge(total), updates), state

  return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def _refuse(x):
  if x > POISON / 2:
    raise ValueError("the callback refuses this batch")


def _callback_loss(params, batch):
  jax.debug.callback(_refuse, jnp.max(batch["x"]))
  return m.mlp_loss(params, batch)


def _engine(loss: Callable[..., Any], devices: int, tx: Any = None,
            **config) -> zj.Engine:
  # (Per device: the out-of-memory loss is traced for a device's slice of
  # BAD_ROWS_PER_DEVICE rows, which a global loss never sees.)
  return zj.Engine(loss, tx or m.OPTIMIZERS["adamw"](m.LR_SCALE["mlp"]),
                   zj.ZeroConfig(stage=3, min_shard_elements=0,
                                 loss_scope="per_device", **config),
                   zj.make_mesh(num_devices=devices))


def _error(e: BaseException) -> dict[str, Any]:
  cause = e.__cause__
  return {"type": type(e).__name__, "message": str(e),
          "jax_runtime": isinstance(e, jax.errors.JaxRuntimeError),
          "cause": None if cause is None else type(cause).__name__,
          "cause_message": None if cause is None else str(cause)}


def _attempt(fn: Callable[[], Any]) -> tuple[Any, dict[str, Any] | None]:
  """``(fn(), None)``, or ``(None, the error)``."""
  try:
    return fn(), None
  except Exception as e:  # pylint: disable=broad-except
    return None, _error(e)


def _train(engine, state, batches, out: dict[str, Any], name: str,
           directory: str) -> None:
  """Trains on, records the losses and saves the final parameters."""
  state, losses = m.run_steps(engine, state, batches)
  out["losses"] = losses
  params = jax.tree.map(np.asarray, engine.gather_params(state))
  np.savez(os.path.join(directory, f"{name}.npz"), **params)


def _bad_oom_batch(devices: int) -> dict[str, np.ndarray]:
  return m.mlp_batches(1, batch=BAD_ROWS_PER_DEVICE * devices, seed=9)[0]


def _two_steps_saved(directory: str, name: str):
  """An 8-device engine whose loss runs out of memory on a bad batch, its
  batches, and its state after 2 steps, saved in ``directory/name``."""
  engine = _engine(_oom_loss, 8)
  batches = m.mlp_batches()
  state, _ = m.run_steps(engine, engine.init(m.mlp_params()), batches[:2])
  with zj.Checkpointer(os.path.join(directory, name)) as ckpt:
    ckpt.save(state, engine=engine)
    ckpt.wait()
  return engine, batches, state


def oom_detected_by_the_next_step(directory: str) -> dict[str, Any]:
  """8 devices: the OOM surfaces at the next engine.step; retries; then
  engine.init trains on (the whole run, against the reference)."""
  out = {}
  engine, batches, state = _two_steps_saved(directory, "ckpt")
  out["checkpoint"] = os.path.join(directory, "ckpt")
  # Dispatched without an error (JAX runs it asynchronously).
  state, out["bad_step"] = _attempt(
      lambda: engine.step(state, _bad_oom_batch(8))[0])
  if state is None:
    return out
  _, out["failure"] = _attempt(lambda: engine.step(state, batches[2]))
  _, out["retry"] = _attempt(lambda: engine.step(state, batches[2]))
  _, out["retry_again"] = _attempt(lambda: engine.step(state, batches[2]))
  _train(engine, engine.init(m.mlp_params()), batches, out, "oom_init",
         directory)
  return out


def restore_after_the_user_saw_the_oom(directory: str) -> dict[str, Any]:
  """8 devices: the OOM surfaces at the user's own read of the loss; a
  restore of the checkpoint before it trains on; so does an engine.init
  after the next such failure. (Each recorded on its own: one failing
  does not hide the other.)"""
  out = {}
  engine, batches, state = _two_steps_saved(directory, "ckpt_read")
  with zj.Checkpointer(os.path.join(directory, "ckpt_read")) as ckpt:
    state, metrics = engine.step(state, _bad_oom_batch(8))
    _, out["user_read"] = _attempt(lambda: float(metrics["loss"]))
    restored = ckpt.restore(engine, m.mlp_params())
  out["restored_step"] = int(restored.step)
  _, out["restore_error"] = _attempt(lambda: _train(
      engine, restored, batches[2:], out, "oom_restore", directory))
  state, metrics = engine.step(engine.init(m.mlp_params()),
                               _bad_oom_batch(8))
  _, out["user_read_again"] = _attempt(lambda: float(metrics["loss"]))
  init = {}
  _, out["init_error"] = _attempt(lambda: _train(
      engine, engine.init(m.mlp_params()), batches, init, "oom_reinit",
      directory))
  out["init_losses"] = init.get("losses")
  return out


def callback_on_one_device(directory: str) -> dict[str, Any]:
  """1 device: a host callback raises; a checkpoint is known; retry; then
  engine.init trains on."""
  out = {}
  engine = _engine(_callback_loss, 1)
  batches = m.mlp_batches()
  state, _ = m.run_steps(engine, engine.init(m.mlp_params()), batches[:2])
  known = os.path.join(directory, "known")
  _last_checkpoint.record(known, 2)
  out["hint"] = _last_checkpoint.last().restore_hint()
  poisoned = dict(batches[2], x=batches[2]["x"] + POISON)
  # (On one device the error is raised as the step is dispatched; were it
  # raised later, the next call would report it: either is right.)
  new, out["failure"] = _attempt(lambda: engine.step(state, poisoned)[0])
  out["failed_at"] = "dispatch"
  if new is not None:
    state = new
    _, out["failure"] = _attempt(lambda: engine.step(state, batches[2]))
    out["failed_at"] = "next step"
  _, out["retry"] = _attempt(lambda: engine.step(state, batches[2]))
  _train(engine, engine.init(m.mlp_params()), batches, out,
         "callback_init", directory)
  return out


def host_update_keeps_the_state(directory: str) -> dict[str, Any]:
  """update_on="host", 8 devices: the device's program runs out of memory;
  the state given was not donated and trains on."""
  out = {}
  engine = _engine(_oom_loss, 8, offload_optimizer="host",
                   update_on="host")
  batches = m.mlp_batches()
  state, _ = m.run_steps(engine, engine.init(m.mlp_params()), batches[:2])
  _, out["failure"] = _attempt(
      lambda: engine.step(state, _bad_oom_batch(8)))
  _train(engine, state, batches[2:], out, "host_kept", directory)
  return out


def delayed_host_update(directory: str) -> dict[str, Any]:
  """update_on="host" with delay_update, 8 devices: the host's update of
  step 1 runs out of memory while the device computes step 2; the error
  comes at the second call and names step 1."""
  del directory
  out = {}
  engine = _engine(m.mlp_loss, 8, tx=optax.chain(_huge_update(),
                                                 optax.adamw(1e-2)),
                   offload_optimizer="host", update_on="host",
                   delay_update=True)
  batches = m.mlp_batches(3)
  state = engine.init(m.mlp_params())
  out["calls"] = []
  for batch in batches:
    new, error = _attempt(lambda b=batch: engine.step(state, b)[0])
    out["calls"].append(error)
    state = state if new is None else new
  return out


SCENARIOS = (oom_detected_by_the_next_step,
             restore_after_the_user_saw_the_oom, callback_on_one_device,
             host_update_keeps_the_state, delayed_host_update)


def main(directory: str, names: list[str]) -> None:
  results = {}
  for scenario in SCENARIOS:
    if names and scenario.__name__ not in names:
      continue
    try:
      results[scenario.__name__] = scenario(directory)
    except Exception:  # pylint: disable=broad-except
      results[scenario.__name__] = {"crash": traceback.format_exc()}
  with open(os.path.join(directory, "results.json"), "w",
            encoding="utf-8") as f:
    json.dump(results, f)
  print("DONE", flush=True)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2:])
