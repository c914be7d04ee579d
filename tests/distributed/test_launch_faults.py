"""Faults under zero_jax.launch: sys.exit(n), a signal, a hang (--watchdog).

The end-to-end tests launch two real JAX processes (1 CPU device each,
collectives over gloo) running tests/distributed/_fault_script.py, each under a time
limit, so that a regression fails instead of hanging.
"""

from __future__ import annotations

import builtins
import faulthandler
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from zero_jax.distributed import _runtime as distributed

from zero_jax.distributed import _failfast as failfast

from zero_jax.distributed import _launcher as launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join("tests", "distributed", "_fault_script.py")


def _launch(*args: str, timeout: float) -> tuple[int, str, float]:
  """Runs the launcher; returns its exit status, output and duration."""
  t0 = time.monotonic()
  proc = subprocess.run(
      [sys.executable, "-m", "zero_jax.launch", *args], cwd=ROOT,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      timeout=timeout)
  return proc.returncode, proc.stdout, time.monotonic() - t0


def _faulty(mode: str, *options: str,
            timeout: float) -> tuple[int, str, float]:
  return _launch("--nproc", "2", "--devices-per-proc", "1", *options, SCRIPT,
                 mode, timeout=timeout)


# ------------------------------------------------- two real JAX processes


@pytest.mark.parametrize("mode", ["exit", "raise"])
def test_sys_exit_in_one_process_is_the_launchers_exit_code(mode):
  """sys.exit(3), or raise SystemExit(3), after a few collectives: JAX's
  shutdown barrier would hold both processes for 300 s, then abort (134);
  fail_fast ends the job at once, and the launcher returns 3."""
  rc, out, elapsed = _faulty(mode, timeout=60)
  print(f"\n{mode} with code 3 in process 1: launcher exited {rc} after "
        f"{elapsed:.1f} s, start-up included")
  assert rc == 3, out[-5000:]
  assert "[1] process 1 took 3 steps" in out
  assert "process 1 exited with code 3" in out
  assert elapsed < 30, out[-5000:]


def test_killed_process_gives_128_plus_the_signal():
  rc, out, elapsed = _faulty("kill", timeout=60)
  print(f"\nprocess 1 SIGKILLed: launcher exited {rc} after {elapsed:.1f} "
        "s, start-up included")
  assert rc == 128 + signal.SIGKILL, out[-5000:]
  assert "process 1 exited with code 137" in out
  # Start-up, then at most the failure grace period (5 s) for process 0.
  assert elapsed < 30, out[-5000:]


def test_watchdog_prints_the_stacks_and_ends_a_hung_job():
  """Process 1 hangs after 3 steps; process 0 waits in the next collective.
  Neither JAX nor fail_fast notices (both are alive); the watchdog does."""
  rc, out, elapsed = _faulty("hang", "--watchdog", "20", timeout=90)
  print(f"\nprocess 1 hung: launcher exited {rc} after {elapsed:.1f} s, "
        "start-up included")
  assert rc == launch.WATCHDOG_EXIT_CODE, out[-5000:]
  assert "watchdog: no training step in 20 s" in out
  lines = out.splitlines()
  # faulthandler's dumps, in each process's stderr: where process 1 hangs,
  # and the collective process 0 waits in.
  assert any(l.startswith("[1] ") and "in hang_here" in l for l in lines), \
      out[-5000:]
  assert any(l.startswith("[0] ") and "_fault_script.py" in l and
             "in step" in l for l in lines), out[-5000:]
  assert elapsed < 60, out[-5000:]


# ----------------------------------------------------- plain processes


def test_watchdog_without_zero_jax(tmp_path):
  """A script that never imports zero_jax.distributed has no stack dump
  (the signal would kill it) and never reports a step: the watchdog says so
  and ends it."""
  script = tmp_path / "sleepy.py"
  script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
  rc, out, elapsed = _launch("--nproc", "2", "--watchdog", "1",
                             str(script), timeout=30)
  assert rc == launch.WATCHDOG_EXIT_CODE, out
  assert "process 0 has no stack to print" in out
  assert "process 1 has no stack to print" in out
  assert elapsed < 20, out


def test_sys_exit_0_in_one_process_is_no_failure(tmp_path):
  script = tmp_path / "early.py"
  script.write_text(textwrap.dedent("""
      import os, sys, time
      if os.environ["ZERO_JAX_PROCESS_ID"] == "1":
        sys.exit(0)
      time.sleep(1)
      print("process 0 finished", flush=True)
      """))
  rc, out, _ = _launch("--nproc", "2", str(script), timeout=30)
  assert rc == 0, out
  assert "[0] process 0 finished" in out
  assert "terminating" not in out


def test_launcher_argument_errors(capsys):
  with pytest.raises(SystemExit):
    launch.main(["--nproc", "1", "--watchdog", "0", "x.py"])
  assert "--watchdog must be > 0" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    launch.main(["--nproc", "1", "--failure-grace-period", "-1", "x.py"])
  assert "--failure-grace-period must be >= 0" in capsys.readouterr().err


def test_failure_grace_period_defaults_to_at_most_the_grace_period():
  def grace(*args):
    return launch._Launcher(["x"], 1, None, 0, *args).failure_grace
  assert grace(30.0) == launch.DEFAULT_FAILURE_GRACE_SECONDS
  assert grace(1.0) == 1.0
  assert grace(30.0, 12.0) == 12.0


# ------------------------------------------------------------ in-process


def test_heartbeat(tmp_path):
  path = tmp_path / "heartbeat0"
  assert failfast._start_heartbeat({}) is None
  heartbeat = failfast._start_heartbeat(
      {distributed.ENV_HEARTBEAT_FILE: str(path)})
  try:
    # Created with mtime 0: running, no step yet.
    assert os.stat(path).st_mtime_ns == 0
    heartbeat.beat()
    first = os.stat(path).st_mtime_ns
    assert first > 0
    os.utime(path, ns=(1, 1))
    heartbeat.beat()  # (within a second of the last touch: nothing)
    assert os.stat(path).st_mtime_ns == 1
    # A second importer (a subprocess inheriting the variable) keeps it.
    failfast._Heartbeat(str(path)).create()
    assert os.stat(path).st_mtime_ns == 1
  finally:
    faulthandler.unregister(distributed.STACK_DUMP_SIGNAL)


def test_step_done_without_the_launcher_is_cheap():
  # (The launcher's variable is not set in the test process.)
  assert failfast._heartbeat is None
  t0 = time.perf_counter()
  for _ in range(100_000):
    distributed.step_done()
  per_call = (time.perf_counter() - t0) / 100_000
  assert per_call < 20e-6, per_call


class _FakeClient:
  def __init__(self):
    self.store = {}

  def key_value_set(self, key, value):
    if key in self.store:
      raise RuntimeError(f"ALREADY_EXISTS: {key}")
    self.store[key] = value

  def key_value_try_get(self, key):
    if key not in self.store:
      raise RuntimeError(f"NOT_FOUND: {key}")
    return self.store[key]


def test_fail_fast_sees_sys_exit(monkeypatch):
  previous_exit, previous_builtin = sys.exit, builtins.exit
  guard = failfast._FailFast(_FakeClient(), process_id=1)
  monkeypatch.setattr(failfast, "_fail_fast", guard)
  guard.start()
  try:
    assert sys.exit is not previous_exit and builtins.exit is not \
        previous_builtin
    with pytest.raises(SystemExit) as e:
      sys.exit(3)
    assert e.value.code == 3 and guard.exit_requested == 3
    with pytest.raises(SystemExit):
      builtins.exit(6)  # exit() and quit() (site's) too
    assert guard.exit_requested == 6
    failfast.main_exited(7)  # the launcher's runner: raise SystemExit(7)
    assert guard.exit_requested == 7
    with pytest.raises(SystemExit):
      sys.exit("a message")
    assert guard.exit_requested == 1  # (as Python exits for a string)
    # sys.exit in another thread ends only that thread.
    guard.exit_requested = None

    def exit_thread():
      try:
        sys.exit(5)
      except SystemExit:
        pass

    t = threading.Thread(target=exit_thread)
    t.start()
    t.join()
    assert guard.exit_requested is None
    # A step after a caught sys.exit: training went on, no failure.
    with pytest.raises(SystemExit):
      sys.exit(4)
    distributed.step_done()
    assert guard.exit_requested is None
  finally:
    guard.stop()
  assert sys.exit is previous_exit and builtins.exit is previous_builtin
  assert not guard._thread.is_alive()


def test_fail_fast_publishes_the_exit_code():
  client = _FakeClient()
  first = failfast._FailFast(client, process_id=1)
  first._fail(3, "process 1 exited with code 3 (sys.exit)")
  assert first._exit_code == 3
  value = client.store["zero_jax/abort"]
  assert failfast._parse_abort(value) == (
      3, "process 1 exited with code 3 (sys.exit)")
  # A later failure (process 0's collective with the dead process) takes
  # the first one's code.
  second = failfast._FailFast(client, process_id=0)
  second._fail(1, "process 0 failed with ValueError: Gloo AllGather failed")
  assert second._exit_code == 3
  # An uncaught exception's code (1) leaves the message as it was.
  assert failfast._abort_value(1, "process 1 failed with E: x") == \
      "process 1 failed with E: x"
  assert failfast._parse_abort("process 1 failed with E: x") == (
      1, "process 1 failed with E: x")
