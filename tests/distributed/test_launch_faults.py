"""Faults under zero_jax.launch: sys.exit(n), a signal, a hang (--watchdog).

The end-to-end tests launch two real JAX processes (1 CPU device each,
collectives over gloo) running tests/distributed/_fault_script.py, each
under a time limit, so that a regression fails instead of hanging. The
watchdog's jobs start with the module (``background``) and are checked by
their tests later: the seconds without a step that a watchdog waits for,
which their processes spend blocked or asleep, pass while the other tests
run.
"""

from __future__ import annotations

import builtins
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

from zero_jax import distributed
from zero_jax.distributed import _failfast as failfast
from zero_jax.distributed import _launcher as launch
from zero_jax.distributed import _spawn as spawn
from zero_jax.train import _hooks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
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


class _Background:
  """A launcher run in the background: its output line by line as it comes,
  then its exit status and duration (start-up included)."""

  def __init__(self, *args: str):
    self.t0 = time.monotonic()
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "zero_jax.launch", *args], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    self.lines: list[str] = []
    self.elapsed: float | None = None
    self.changed = threading.Condition()
    self.reader = threading.Thread(target=self._read, daemon=True)
    self.reader.start()

  def _read(self) -> None:
    for line in self.proc.stdout:
      with self.changed:
        self.lines.append(line)
        self.changed.notify_all()
    self.proc.wait()
    with self.changed:
      self.elapsed = time.monotonic() - self.t0
      self.changed.notify_all()

  def wait_for(self, *texts: str, timeout: float) -> None:
    """Until every text is in the output, or the run ended."""
    with self.changed:
      self.changed.wait_for(
          lambda: self.elapsed is not None or all(
              any(t in l for l in self.lines) for t in texts), timeout)

  def result(self, timeout: float) -> tuple[int, str, float]:
    """The exit status, output and duration, as ``_launch`` returns them;
    fails (killing the run) if it has not ended within ``timeout``."""
    self.reader.join(timeout)
    if self.reader.is_alive():
      self.proc.kill()
      pytest.fail("the launcher did not end: " + "".join(self.lines)[-5000:])
    return self.proc.returncode, "".join(self.lines), self.elapsed

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()  # (its processes die with it: _spawn.tied_command)
    self.reader.join(30)


_SLEEPY = textwrap.dedent("""
    import sys, time
    def sleepy_here():
      time.sleep(60)
    loaded = sorted(m for m in sys.modules if m.startswith("zero_jax"))
    print("zero_jax modules:", loaded, flush=True)
    sleepy_here()
    """)


@pytest.fixture(scope="module", autouse=True)
def background(request, tmp_path_factory):
  """The watchdog's jobs, started before the module's other tests, which
  run while the watchdogs wait (only the jobs whose tests are selected):

  - "hang": ``test_watchdog_prints_the_stacks_and_ends_a_hung_job``'s. Its
    processes start alone (the watchdog's limit covers start-up); once
    both have taken their steps and stopped, the other tests run while
    the watchdog waits out its 20 s.
  - "sleepy": ``test_watchdog_prints_the_stack_of_a_script_without_
    zero_jax``'s, two plain processes (no JAX) that print and sleep.
  """
  selected = {item.name for item in request.session.items
              if item.module is request.module}
  jobs = {}
  if "test_watchdog_prints_the_stacks_and_ends_a_hung_job" in selected:
    jobs["hang"] = _Background("--nproc", "2", "--devices-per-proc", "1",
                               "--watchdog", "20", SCRIPT, "hang")
    jobs["hang"].wait_for("[0] process 0 took 3 steps",
                          "[1] process 1 took 3 steps", timeout=90)
  if ("test_watchdog_prints_the_stack_of_a_script_without_zero_jax" in
      selected):
    script = tmp_path_factory.mktemp("sleepy") / "sleepy.py"
    script.write_text(_SLEEPY)
    jobs["sleepy"] = _Background("--nproc", "2", "--watchdog", "3",
                                 str(script))
    # (Its 3 s cover start-up: the next tests' JAX processes start once
    # both are asleep, as the test alone would have them.)
    jobs["sleepy"].wait_for("[0] zero_jax modules:",
                            "[1] zero_jax modules:", timeout=30)
  yield jobs
  for job in jobs.values():
    job.stop()


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


# ----------------------------------------------------- plain processes


def test_watchdog_prints_the_stack_of_a_script_without_zero_jax(background):
  """A script that never imports zero_jax (nor reports a step) still has
  its stack dump: the launcher's runner registers it before the script
  starts. The watchdog prints where each process hangs and ends the job.
  (The job ran in the background since the module started: ``_SLEEPY``.)"""
  rc, out, elapsed = background["sleepy"].result(timeout=40)
  assert rc == launch.WATCHDOG_EXIT_CODE, out
  lines = out.splitlines()
  for i in range(2):
    assert f"[{i}] zero_jax modules: []" in lines, out
    assert any(l.startswith(f"[{i}] ") and "in sleepy_here" in l
               for l in lines), out
  assert "no stack to print" not in out
  assert elapsed < 25, out


def test_watchdog_spares_a_process_without_the_stack_dump(capfd):
  """A process whose runner has not registered the stack dump (here: one
  started without the runner) has no heartbeat file: the watchdog sends it
  no signal, which would kill it, and ends it with SIGTERM."""
  command = [sys.executable, "-c", textwrap.dedent("""
      import signal, sys, time
      def on_term(*_):
        print("got SIGTERM", flush=True)
        sys.exit(0)
      signal.signal(signal.SIGTERM, on_term)
      time.sleep(60)
      """)]
  launcher = launch._Launcher(command, 1, None, spawn.free_port(), 30.0,
                              watchdog=1.0)
  assert launcher.run() == launch.WATCHDOG_EXIT_CODE
  out, err = capfd.readouterr()
  assert "process 0 has no stack to print" in err
  assert "[0] got SIGTERM" in out  # (alive until then: no SIGUSR1)


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


@pytest.mark.parametrize("argv,message", [
    # float() takes these: a NaN grace period compares false with every
    # time, so the launcher would never kill.
    (["--grace-period", "nan"],
     "--grace-period must be a finite number of seconds, got nan"),
    (["--grace-period", "inf"],
     "--grace-period must be a finite number of seconds, got inf"),
    (["--grace-period", "-1"], "--grace-period must be >= 0, got -1"),
    (["--failure-grace-period", "nan"],
     "--failure-grace-period must be a finite number of seconds, got nan"),
    (["--failure-grace-period=-inf"],
     "--failure-grace-period must be a finite number of seconds, got -inf"),
    (["--watchdog", "nan"],
     "--watchdog must be a finite number of seconds, got nan; leave it out "
     "to turn the watchdog off"),
    (["--watchdog", "inf"],
     "--watchdog must be a finite number of seconds, got inf"),
    (["--watchdog=-5"], "--watchdog must be > 0 (seconds without a training "
     "step), got -5"),
    (["--port", "70000"], "--port must be a TCP port, 1 to 65535"),
    (["--port=-1"], "--port must be a TCP port, 1 to 65535"),
    (["--devices-per-proc", "0"], "--devices-per-proc must be >= 1, got 0"),
])
def test_launcher_refuses_numbers_it_cannot_act_on(capsys, argv, message):
  with pytest.raises(SystemExit) as e:
    launch.main(["--nproc", "2", *argv, "x.py"])
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def test_processes_that_fail_together_fail_the_job(capfd, tmp_path,
                                                   monkeypatch):
  """Both processes exit 3 between two of the launcher's looks (every 50
  ms), so that it sees no failure until every process has ended: the job
  still fails with code 3.

  Made certain, not timed: both processes wait for a file that the
  launcher's first pause (after a look that found both running) creates,
  and that pause lasts until both have exited. (A shared wall-clock moment
  failed under load: one process, late to start, was still running at the
  next look and got the SIGTERM, 143.)"""
  go = tmp_path / "go"
  command = [sys.executable, "-c", "import os, sys, time\n"
             "while not os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
             "sys.exit(3)", str(go)]
  launcher = launch._Launcher(command, 2, None, spawn.free_port(), 30.0)
  pauses = []

  def pause(seconds):
    pauses.append(seconds)
    go.touch()
    deadline = time.monotonic() + 60
    while len(launcher.exits) < 2 and time.monotonic() < deadline:
      time.sleep(0.01)

  # (The launcher's own module reference: nothing else's sleep changes.)
  monkeypatch.setattr(launch, "time", types.SimpleNamespace(
      monotonic=time.monotonic, sleep=pause))
  assert launcher.run() == 3
  assert sorted(launcher.exits) == [(0, 3), (1, 3)]
  # One pause: the look after it found both exited, as one event.
  assert pauses == [0.05]
  capfd.readouterr()


def test_failure_grace_period_defaults_to_at_most_the_grace_period():
  def grace(*args):
    return launch._Launcher(["x"], 1, None, 0, *args).failure_grace
  assert grace(30.0) == launch.DEFAULT_FAILURE_GRACE_SECONDS
  assert grace(1.0) == 1.0
  assert grace(30.0, 12.0) == 12.0


# ------------------------------------------------------------ in-process


def test_the_runner_registers_the_stack_dump_and_creates_the_heartbeat(
    tmp_path):
  """Under --watchdog the launcher's runner registers the stack dump and
  creates the heartbeat file with mtime 0 (running, no step yet) before the
  script runs; a second runner (a process inheriting the variable) keeps
  the file; without the variable it sets up neither."""
  script = tmp_path / "probe.py"
  script.write_text(textwrap.dedent("""
      import faulthandler, os, signal, sys
      path = os.environ.get("ZERO_JAX_HEARTBEAT_FILE")
      print(os.stat(path).st_mtime_ns if path else None,
            faulthandler.unregister(signal.SIGUSR1),
            sorted(m for m in sys.modules if m.startswith(("jax", "zero_"))))
      """))
  path = tmp_path / "heartbeat0"
  env = {k: v for k, v in os.environ.items()
         if k != _hooks.ENV_HEARTBEAT_FILE}

  def run(**extra: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", spawn.RUNNER, "--", str(script)],
        env={**env, **extra}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()

  assert spawn.STACK_DUMP_SIGNAL == signal.SIGUSR1
  assert run(ZERO_JAX_HEARTBEAT_FILE=str(path)) == "0 True []"
  os.utime(path, ns=(1, 1))  # (a step)
  assert run(ZERO_JAX_HEARTBEAT_FILE=str(path)) == "1 True []"
  assert run() == "None False []"


def test_step_done_touches_the_heartbeat_at_most_once_a_second(
    monkeypatch, tmp_path):
  path = tmp_path / "heartbeat0"
  path.touch()
  os.utime(path, ns=(0, 0))  # (as the runner leaves it)
  monkeypatch.setenv(_hooks.ENV_HEARTBEAT_FILE, str(path))
  monkeypatch.setattr(_hooks, "_due", 0.0)
  distributed.step_done()
  assert os.stat(path).st_mtime_ns > 0
  os.utime(path, ns=(1, 1))
  distributed.step_done()  # (within a second of the last touch: nothing)
  assert os.stat(path).st_mtime_ns == 1
  # The launcher removed the file (it is ending the job): touched, never
  # created.
  path.unlink()
  monkeypatch.setattr(_hooks, "_due", 0.0)
  distributed.step_done()
  assert not path.exists()


def test_step_done_without_the_launcher_is_cheap(monkeypatch):
  monkeypatch.delenv(_hooks.ENV_HEARTBEAT_FILE, raising=False)
  t0 = time.perf_counter()
  for _ in range(100_000):
    distributed.step_done()
  per_call = (time.perf_counter() - t0) / 100_000
  assert per_call < 20e-6, per_call


def test_the_watchdog_counts_steps_and_knows_who_can_dump(tmp_path):
  ready, missing = tmp_path / "heartbeat0", tmp_path / "heartbeat1"
  ready.touch()
  os.utime(ready, ns=(0, 0))  # process 0's runner is up; process 1's not
  watchdog = failfast.Watchdog(0.2, [str(ready), str(missing)])
  time.sleep(0.3)
  assert watchdog.stuck([0, 1]) == [0, 1]  # (mtime 0 is no step)
  assert watchdog.has_handler(0) and not watchdog.has_handler(1)
  os.utime(ready)  # a step
  watchdog.next_check = 0.0  # (it looks at most every half second)
  assert watchdog.stuck([0, 1]) == [1]
  assert watchdog.idle(1) >= 0.3


# What importing zero_jax.distributed changes in a process, run fresh (this
# one has imported it already). JAX is imported first: its own import sets
# environment variables.
_IMPORT_PROBE = """
import faulthandler, json, os, signal, sys, threading
import jax
def snapshot():
  return {"environ": dict(os.environ), "threads": threading.active_count(),
          "sigusr1": repr(signal.getsignal(signal.SIGUSR1)),
          "excepthook": repr(sys.excepthook), "exit": repr(sys.exit)}
before = snapshot()
import zero_jax.distributed
after = snapshot()
jax.devices()
zero_jax.distributed.step_done()
print(json.dumps({"before": before, "after": after,
                  "devices": snapshot()["sigusr1"],
                  "stack_dump": faulthandler.unregister(signal.SIGUSR1)}))
"""


def test_importing_zero_jax_distributed_changes_nothing(tmp_path):
  """Under the launcher's watchdog variable, importing the package (and
  starting JAX's backend, and a step) registers no stack dump and creates
  no heartbeat file: both are the launcher's runner's."""
  beat = tmp_path / "heartbeat0"
  env = {k: v for k, v in os.environ.items()
         if not k.startswith("ZERO_JAX_")}
  env.update(ZERO_JAX_HEARTBEAT_FILE=str(beat), JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  r = json.loads(out.stdout.strip().splitlines()[-1])
  assert not beat.exists()
  assert r["after"]["environ"] == r["before"]["environ"]
  assert r["after"]["threads"] == r["before"]["threads"]
  assert r["after"] == r["before"]
  assert r["after"]["sigusr1"] == r["devices"] == repr(signal.SIG_DFL)
  # (getsignal does not see faulthandler's C-level handler; this does.)
  assert r["stack_dump"] is False


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


def test_fail_fast_sees_sys_exit():
  previous_exit, previous_builtin = sys.exit, builtins.exit
  failfast.start_fail_fast(_FakeClient(), process_id=1)
  guard = failfast._fail_fast
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
    assert guard.exit_requested == 4
    distributed.step_done()
    assert guard.exit_requested is None
  finally:
    failfast.stop_fail_fast()
  assert sys.exit is previous_exit and builtins.exit is previous_builtin
  assert not guard._thread.is_alive()
  # Disarmed, it no longer listens to the steps.
  guard.exit_requested = 4
  distributed.step_done()
  assert guard.exit_requested == 4
  failfast.main_exited(5)  # (and the runner's report goes nowhere)
  assert guard.exit_requested == 4


def test_fail_fast_starts_no_thread_at_exit(monkeypatch):
  """A sys.exit(3) is published by fail-fast's atexit handler, where Python
  3.12 refuses to start a thread ("can't create new thread at interpreter
  shutdown"; the job hung there): the watchdog thread, started when
  fail-fast was armed, takes the error to the coordinator, and the process
  exits with code 3. (Thread.start refuses here on every Python.)"""
  client = _FakeClient()
  monkeypatch.setattr(failfast, "_client", lambda: client)
  guard = failfast._FailFast(client, process_id=1)
  guard.start()
  exits = []
  try:
    with pytest.raises(SystemExit):
      sys.exit(3)

    def refuse(self):
      raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    monkeypatch.setattr(failfast.os, "_exit", exits.append)
    t0 = time.monotonic()
    guard._at_exit()
    elapsed = time.monotonic() - t0
  finally:
    monkeypatch.undo()
    guard.stop()
  assert exits == [3]
  assert failfast._parse_abort(client.store["zero_jax/abort"]) == (
      3, "process 1 exited with code 3 (SystemExit)")
  assert elapsed < failfast._PUBLISH_SECONDS  # (published, not timed out)
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


# --------------------------------------- the hung job, started with the module


def test_watchdog_prints_the_stacks_and_ends_a_hung_job(background):
  """Process 1 hangs after 3 steps; process 0 waits in the next collective.
  Neither JAX nor fail_fast notices (both are alive); the watchdog does.
  (The job ran in the background since the module started.)"""
  rc, out, elapsed = background["hang"].result(timeout=90)
  print(f"\nprocess 1 hung: launcher exited {rc} after {elapsed:.1f} s, "
        "start-up included")
  assert rc == launch.WATCHDOG_EXIT_CODE, out[-5000:]
  assert "watchdog: no training step in 20 s" in out
  lines = out.splitlines()
  # Both took their steps before the watchdog fired (start-up was within
  # its limit).
  for i in range(2):
    assert f"[{i}] process {i} took 3 steps" in lines, out[-5000:]
  # faulthandler's dumps, in each process's stderr: where process 1 hangs,
  # and the collective process 0 waits in.
  assert any(l.startswith("[1] ") and "in hang_here" in l for l in lines), \
      out[-5000:]
  assert any(l.startswith("[0] ") and "_fault_script.py" in l and
             "in step" in l for l in lines), out[-5000:]
  assert elapsed < 60, out[-5000:]
