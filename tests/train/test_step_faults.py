"""Steps that fail at run time: the error names the step, whether the state
given to it survives, the last checkpoint and the fix; no error is raised
twice; a state from ``engine.init`` or a restore trains on as single-device
optax does.

The faults run in a subprocess with a time limit (a fault that hung would
otherwise hold the suite): ``tests/train/_step_fault_worker.py`` makes
steps run out of memory and host callbacks raise, and writes what
happened for the tests below.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests import _models as m

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
TIME_LIMIT_S = 240  # (about 10 s and 5 s on 2 cores)


def _run_worker(out, *scenarios: str) -> tuple[dict, object]:
  """Runs the scenarios in a process of their own; returns (results, the
  output folder)."""
  # (With the run's XLA_FLAGS and compilation cache: tests/conftest.py.)
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  try:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.train._step_fault_worker", str(out),
         *scenarios], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=TIME_LIMIT_S)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"the step fault worker did not end within {TIME_LIMIT_S} "
                f"s: {(e.stdout or b'')[-3000:]!r}")
  log = proc.stdout + proc.stderr
  assert proc.returncode == 0 and "DONE" in proc.stdout, log[-5000:]
  (out / "stderr.txt").write_text(proc.stderr)
  with open(out / "results.json", encoding="utf-8") as f:
    return json.load(f), out


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
  """The scenarios on one device's or eight devices' step."""
  return _run_worker(tmp_path_factory.mktemp("step_faults"),
                     "oom_detected_by_the_next_step",
                     "restore_after_the_user_saw_the_oom",
                     "callback_on_one_device", "host_update_keeps_the_state")


@pytest.fixture(scope="module")
def delayed_worker(tmp_path_factory):
  """The delayed host update, in a process of its own (without the fix,
  the steps after its failure crash the process)."""
  return _run_worker(tmp_path_factory.mktemp("step_faults_delayed"),
                     "delayed_host_update")


def _scenario(worker, name: str) -> dict:
  results, _ = worker
  result = results[name]
  assert "crash" not in result, result.get("crash")
  return result


def _assert_trains_like_optax(worker, scenario: str, run: str,
                              first: int, losses: str = "losses") -> None:
  """The run the scenario saved as RUN (on the batches from ``first``; its
  losses under LOSSES) matches single-device optax over all the
  batches."""
  result = _scenario(worker, scenario)
  ref_losses, ref_params = m.cached_reference("mlp", "adamw")
  params = dict(np.load(worker[1] / f"{run}.npz"))
  m.assert_matches(result[losses], params, ref_losses[first:], ref_params)


def _assert_names(message: str, *words: str) -> None:
  for w in words:
    assert w in message, f"{w!r} not in: {message}"


def _assert_lost_state_error(error: dict, hint: str) -> None:
  """A step given a state that the failure took: says so plainly, and how
  to get a state again; not the old error, nor that a step returned a
  state to use."""
  assert error is not None, "a lost state was taken by engine.step"
  assert error["type"] == "ValueError" and not error["jax_runtime"], error
  _assert_names(error["message"], "lost when step 3 failed at run time",
                hint, "engine.init(params)")
  assert "returned the state to use instead" not in error["message"]


# ------------------------------------------------ out of memory, 8 devices


def test_an_oom_shown_at_the_next_step_names_the_step_the_state_and_fix(
    worker):
  result = _scenario(worker, "oom_detected_by_the_next_step")
  assert result["bad_step"] is None  # (dispatched: JAX runs it later)
  error = result["failure"]
  assert error["type"] == "StepFailedError" and error["jax_runtime"], error
  assert error["cause"] == "JaxRuntimeError", error
  assert "RESOURCE_EXHAUSTED" in error["cause_message"]
  ckpt = result["checkpoint"]
  _assert_names(
      error["message"], "step 3 failed at run time", "RESOURCE_EXHAUSTED",
      "out of memory", "smaller batch", "micro_batch_size", "remat",
      "offload_optimizer='host'", "donated to it and is gone",
      # (the checkpoint the Checkpointer saved before the failure)
      f"zero_jax.Checkpointer({ckpt!r}).restore(engine, params, step=2)",
      "engine.init(params)")


def test_an_oom_is_explained_on_stderr_as_it_happens(worker):
  # The user's own read of the metrics raises JAX's bare error; the
  # explanation is printed as the step fails, once per failure.
  log = (worker[1] / "stderr.txt").read_text()
  _assert_names(log, "zero_jax: engine.step: step 3 failed at run time "
                "(RESOURCE_EXHAUSTED", "It ran out of memory",
                "donated to it and is gone", "reading its metrics raises it",
                "the next engine.step raises StepFailedError")
  assert log.count("step 3 failed at run time (RESOURCE_EXHAUSTED") == 2, (
      log)  # (the two scenarios that run out of memory)


def test_a_retry_with_the_lost_state_says_so_and_never_reraises(worker):
  result = _scenario(worker, "oom_detected_by_the_next_step")
  hint = f"Checkpointer({result['checkpoint']!r})"
  _assert_lost_state_error(result["retry"], hint)
  assert result["retry_again"] == result["retry"]


def test_init_after_a_failure_starts_clean_and_matches_optax(worker):
  # After the failure engine.step reported, and after one the user's own
  # read of the loss raised.
  _assert_trains_like_optax(worker, "oom_detected_by_the_next_step",
                            "oom_init", 0)
  result = _scenario(worker, "restore_after_the_user_saw_the_oom")
  assert result["user_read_again"]["type"] == "JaxRuntimeError"
  assert result["init_error"] is None, result["init_error"]
  _assert_trains_like_optax(worker, "restore_after_the_user_saw_the_oom",
                            "oom_reinit", 0, losses="init_losses")


def test_a_restore_after_a_failure_the_user_saw_trains_on(worker):
  # The user's own read of the loss raised JAX's error; the restored
  # state's first step must not raise it again.
  result = _scenario(worker, "restore_after_the_user_saw_the_oom")
  assert result["user_read"]["type"] == "JaxRuntimeError"
  assert result["restored_step"] == 2
  assert result["restore_error"] is None, result["restore_error"]
  _assert_trains_like_optax(worker, "restore_after_the_user_saw_the_oom",
                            "oom_restore", 2)


# ------------------------------------------- a host callback that raised


def test_a_callback_that_raised_is_named_as_the_cause(worker):
  result = _scenario(worker, "callback_on_one_device")
  error = result["failure"]
  assert error["type"] == "StepFailedError" and error["jax_runtime"], error
  assert error["cause"] == "JaxRuntimeError", error
  _assert_names(error["message"], "step 3 failed at run time",
                "ValueError: the callback refuses this batch",
                "callback's own error is the cause",
                "donated to it and is gone",
                # (the checkpoint this process knows of)
                result["hint"], "engine.init(params)")
  _assert_lost_state_error(result["retry"], result["hint"])
  _assert_trains_like_optax(worker, "callback_on_one_device",
                            "callback_init", 0)


# ---------------------------------------------- a state that survives


def test_a_state_the_failed_step_did_not_donate_trains_on(worker):
  # update_on="host": the device's program takes the state undonated, and
  # failed before the host's update took the master.
  result = _scenario(worker, "host_update_keeps_the_state")
  error = result["failure"]
  assert error["type"] == "StepFailedError" and error["jax_runtime"], error
  _assert_names(error["message"], "step 3 failed at run time",
                "out of memory",
                "not donated and is unchanged: engine.step may take it")
  _assert_trains_like_optax(worker, "host_update_keeps_the_state",
                            "host_kept", 2)


# ------------------------------------- found two steps late (delay_update)


def test_a_failure_found_steps_later_names_the_step_that_failed(
    delayed_worker):
  # The host's update of step 1 fails while the device computes step 2:
  # the error, at the second call, names step 1, and the state step 1
  # returned is refused after it.
  calls = _scenario(delayed_worker, "delayed_host_update")["calls"]
  assert calls[0] is None, calls[0]
  error = calls[1]
  assert error is not None and error["type"] == "StepFailedError", error
  _assert_names(error["message"], "step 1 failed at run time",
                "out of memory", "shows only now")
  assert "step 2 failed" not in error["message"]
  retry = calls[2]
  assert retry is not None and retry["type"] == "ValueError", retry
  _assert_names(retry["message"], "lost when step 1 failed",
                "engine.init(params)")


# -------------------------------------- out of memory before the dispatch


@pytest.mark.parametrize("error", ["placing", "host"])
def test_memory_running_out_before_the_step_runs_leaves_the_state(
    monkeypatch, error):
  # Under an address-space limit, placing the batch (JAX's
  # RESOURCE_EXHAUSTED) or a host buffer (numpy's MemoryError) can fail
  # before the step takes the state: a StepFailedError that says the state
  # is unchanged and the fix, and the same state trains on.
  # pylint: disable-next=g-import-not-at-top
  import jax
  import optax  # pylint: disable=g-import-not-at-top
  import zero_jax as zj  # pylint: disable=g-import-not-at-top
  engine = zj.Engine(m.mlp_loss, optax.adamw(1e-2), zj.ZeroConfig(
      stage=3, min_shard_elements=0), zj.make_mesh(num_devices=8))
  batches = m.mlp_batches(2)
  state = engine.init(m.mlp_params())
  raised = (jax.errors.JaxRuntimeError(
      "RESOURCE_EXHAUSTED: Out of memory allocating 16777216 bytes.")
            if error == "placing" else
            MemoryError("Unable to allocate 64.0 MiB for an array"))

  def fails(batch):
    raise raised

  monkeypatch.setattr(engine, "shard_batch", fails)
  with pytest.raises(zj.StepFailedError) as info:
    engine.step(state, batches[0])
  _assert_names(str(info.value), "step 1 failed at run time",
                "ran out of memory", "micro_batch_size",
                "not donated and is unchanged: engine.step may take it")
  assert info.value.__cause__ is raised
  monkeypatch.undo()
  losses = []
  for batch in batches:
    state, metrics = engine.step(state, batch)
    losses.append(float(metrics["loss"]))
  ref = optax.adamw(1e-2)
  ref_losses, _ = m.train_reference(m.mlp_loss, ref, m.mlp_params(), batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
