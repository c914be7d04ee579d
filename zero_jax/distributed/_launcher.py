"""Runs a training script as several processes on this machine.

``python -m zero_jax.launch --nproc 2 --devices-per-proc 4 train.py ARGS``
starts two copies of ``train.py ARGS`` that find each other through
``zero_jax.distributed.initialize()`` (which the script calls first). With
``--devices-per-proc N`` each process gets N CPU devices, with cross-process
collectives over gloo: a multi-host run simulated on one machine.

Like ``torchrun``: each process's output is streamed line by line, prefixed
with ``[i]``; if a process fails (exits non-zero: an uncaught exception,
``sys.exit(n)``, a signal), the others get SIGTERM and, after
``--failure-grace-period`` (at most 5 s by default: a multi-process JAX
script ignores SIGTERM), SIGKILL, and the launcher exits with the failed
process's code; SIGTERM and SIGINT sent to the launcher go to every process,
SIGKILL following after ``--grace-period`` (30 s: time for a final
checkpoint). Inside the processes, ``zero_jax.distributed``'s fail_fast
makes a failing process exit at once rather than in JAX's shutdown barrier,
and the others exit with its code.

``--watchdog SECONDS`` ends a job that hangs: when a running process has
gone SECONDS without finishing a training step (counted from its launch
until its first step, so the limit must cover start-up and the first
compilation too), the launcher prints the Python stack of every running
process (through ``faulthandler``, in the process's own stderr, prefixed
``[i]`` like the rest), ends the job as after a failure, and exits 124.
Steps are reported by ``zero_jax.distributed.step_done()``, which
``Engine.step`` calls (a loop without the engine calls it itself). The
launcher's runner registers the stack dump in every process before the
script starts, so a process that hangs before importing ``zero_jax``, or
never imports it, still has its stack printed; importing the package
registers nothing.

A script that never calls ``zero_jax.distributed.initialize()`` would run
as NPROC single processes, each alone on its own devices: ``Engine.step``
refuses that at the first step, and the runner (``_spawn.RUNNER``) when a
script that used JAX otherwise ends (exit code 1); both name the call.
Times that are not finite numbers of seconds >= 0 (``--grace-period nan``
would never kill) are refused with exit status 2.

Exit status:

* 0: every process exited 0 (one that calls ``sys.exit(0)`` early is no
  failure: the others go on).
* the exit code of the first process that failed (exited non-zero), e.g. 3
  for ``sys.exit(3)``, 1 for an uncaught exception; 128 + N for a process
  killed by signal N (137 for SIGKILL), as a shell reports it. (Also when
  every process fails at once.)
* 124 (``WATCHDOG_EXIT_CODE``, like ``timeout``): the watchdog ended the
  job.
* 128 + N: the launcher got signal N (SIGTERM, SIGINT), forwarded it, and
  every process still exited 0.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from typing import IO, Sequence

from zero_jax.distributed._failfast import Watchdog
from zero_jax.distributed._spawn import (RUNNER, STACK_DUMP_SIGNAL,
                                         child_env, free_port, tied_command)

# The launcher's exit status when --watchdog ended the job (as ``timeout``).
WATCHDOG_EXIT_CODE = 124
# After a failure or the watchdog, SIGKILL follows SIGTERM after at most
# this many seconds: a multi-process JAX script ignores SIGTERM (its
# preemption service takes it), and with a peer gone it could not write a
# checkpoint anyway.
DEFAULT_FAILURE_GRACE_SECONDS = 5.0

# How long the processes get to print their stacks before SIGTERM.
_DUMP_SECONDS = 2.0


def _exit_code(returncode: int) -> int:
  """A child's status as a shell reports it (128 + N if killed by N)."""
  return 128 - returncode if returncode < 0 else returncode


def _pump(pipe: IO[bytes], out: IO[str], prefix: str,
          lock: threading.Lock) -> None:
  """Copies ``pipe`` to ``out`` line by line, each line prefixed."""
  raw = getattr(out, "buffer", None)  # (a replaced sys.stdout may have none)
  for line in iter(pipe.readline, b""):
    if not line.endswith(b"\n"):
      line += b"\n"
    with lock:
      if raw is not None:
        out.flush()
        raw.write(prefix.encode() + line)
        raw.flush()
      else:
        out.write(prefix + line.decode(errors="replace"))
        out.flush()
  pipe.close()


def _say(message: str) -> None:
  print(f"[launch] {message}", file=sys.stderr, flush=True)


class _Launcher:
  """Starts the processes, streams their output, and supervises them."""

  def __init__(self, command: list[str], nproc: int,
               devices_per_proc: int | None, port: int, grace: float,
               failure_grace: float | None = None,
               watchdog: float | None = None):
    self.command = command
    self.nproc = nproc
    self.devices_per_proc = devices_per_proc
    self.port = port
    self.grace = grace
    self.failure_grace = (min(grace, DEFAULT_FAILURE_GRACE_SECONDS)
                          if failure_grace is None else failure_grace)
    self.watchdog_limit = watchdog
    self.watchdog: Watchdog | None = None
    self.heartbeat_dir: str | None = None
    self.procs: list[subprocess.Popen] = []
    # (index, exit code) of each process that has exited, in order of exit.
    self.exits: list[tuple[int, int]] = []
    # (Reentrant: the signal handler takes it, and may interrupt the main
    # thread while that holds it.)
    self.exits_lock = threading.RLock()
    self.signalled: int | None = None
    self.kill_at: float | None = None
    self.term_at: float | None = None  # SIGTERM after the stack dumps

  def _start(self) -> list[threading.Thread]:
    paths: list[str | None] = [None] * self.nproc
    if self.watchdog_limit is not None:
      self.heartbeat_dir = tempfile.mkdtemp(prefix="zero_jax_launch_")
      paths = [os.path.join(self.heartbeat_dir, f"heartbeat{i}")
               for i in range(self.nproc)]
      self.watchdog = Watchdog(self.watchdog_limit, paths)
    for i in range(self.nproc):
      self.procs.append(subprocess.Popen(
          tied_command(self.command),
          env=child_env(os.environ, i, self.nproc, self.port,
                        self.devices_per_proc, paths[i]),
          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          # Own session: a Ctrl-C in the terminal reaches the launcher only,
          # which forwards it once; signals go to each child's whole group.
          start_new_session=True))
    lock = threading.Lock()
    threads = []
    for i, p in enumerate(self.procs):
      for pipe, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
        t = threading.Thread(target=_pump, daemon=True,
                             args=(pipe, out, f"[{i}] ", lock))
        t.start()
        threads.append(t)
    return threads

  def _running(self) -> list[int]:
    """The processes that have not exited (as their reapers know)."""
    with self.exits_lock:
      done = {i for i, _ in self.exits}
    return [i for i in range(len(self.procs)) if i not in done]

  def _signal_all(self, sig: int) -> None:
    for i in self._running():
      try:
        os.killpg(self.procs[i].pid, sig)
      except (ProcessLookupError, PermissionError):
        pass

  def _terminate(self) -> None:
    """SIGTERM to every process; SIGKILL after the failure grace period."""
    self._signal_all(signal.SIGTERM)
    self.kill_at = time.monotonic() + self.failure_grace

  def _on_signal(self, sig: int, frame) -> None:
    del frame
    if self.signalled is not None:
      _say(f"got {signal.Signals(sig).name} again: killing every process")
      self._signal_all(signal.SIGKILL)
      return
    self.signalled = sig
    _say(f"got {signal.Signals(sig).name}: forwarding it to every process")
    self._signal_all(sig)
    self.kill_at = time.monotonic() + self.grace

  def _check_watchdog(self, exits: list[tuple[int, int]]) -> bool:
    """Fires the watchdog if a process is stuck: asks every running process
    for its stacks, and schedules the end of the job. Returns whether it
    fired."""
    done = {i for i, _ in exits}
    running = [i for i in range(self.nproc) if i not in done]
    stuck = self.watchdog.stuck(running)
    if not stuck:
      return False
    watchdog = self.watchdog
    ages = ", ".join(f"process {i} for {watchdog.idle(i):.0f} s" for i in stuck)
    _say(f"watchdog: no training step in {watchdog.limit:g} s ({ages}); "
         f"printing the Python stacks of the running processes, then ending "
         f"the job (exit code {WATCHDOG_EXIT_CODE}). If the steps are just "
         "slow (start-up and the first compilation count too), raise "
         "--watchdog.")
    for i in running:
      if not watchdog.has_handler(i):
        _say(f"process {i} has no stack to print: it has not started its "
             "runner, which registers the stack dump")
        continue
      try:
        # (The process itself, not its group: a grandchild without the
        # handler would die of the signal.)
        os.kill(self.procs[i].pid, STACK_DUMP_SIGNAL)
      except ProcessLookupError:
        pass
    self.term_at = time.monotonic() + _DUMP_SECONDS
    return True

  def _reap(self, i: int) -> None:
    """Waits for process ``i``; records its exit, in the order of exits."""
    p = self.procs[i]
    p.wait()
    with self.exits_lock:
      self.exits.append((i, _exit_code(p.returncode)))

  def run(self) -> int:
    # (Signal handlers can only be set from the main thread.)
    previous = ({sig: signal.signal(sig, self._on_signal)
                 for sig in (signal.SIGINT, signal.SIGTERM)}
                if threading.current_thread() is threading.main_thread()
                else {})
    try:
      threads = self._start()
      # One thread waits for each process, so that the launcher knows which
      # failed first, even when the others' failures (a collective with a
      # dead process) follow within milliseconds.
      reapers = [threading.Thread(target=self._reap, args=(i,), daemon=True)
                 for i in range(self.nproc)]
      for t in reapers:
        t.start()
      # The launcher's exit code once the job is failing: the first failed
      # process's, or the watchdog's.
      failed: int | None = None
      while True:
        with self.exits_lock:
          exits = list(self.exits)
        if len(exits) == self.nproc:
          break
        if failed is None:
          first = next(((i, code) for i, code in exits if code != 0), None)
          if first is not None:
            i, failed = first
            # (After a forwarded signal the others have had theirs: a
            # second SIGTERM could cut short a final checkpoint.)
            if self.signalled is None:
              _say(f"process {i} exited with code {failed}: terminating "
                   f"the others (SIGKILL after {self.failure_grace:g} s)")
              self._terminate()
        if (failed is None and self.signalled is None and
            self.watchdog is not None and self._check_watchdog(exits)):
          failed = WATCHDOG_EXIT_CODE
        now = time.monotonic()
        if self.term_at is not None and now >= self.term_at:
          self.term_at = None
          _say(f"terminating every process (SIGKILL after "
               f"{self.failure_grace:g} s)")
          self._terminate()
        if self.kill_at is not None and now >= self.kill_at:
          _say("grace period over: killing the remaining processes")
          self._signal_all(signal.SIGKILL)
          self.kill_at = None
        time.sleep(0.05)
      for t in threads:
        t.join(timeout=5)  # (a grandchild may hold a pipe open)
      if failed is None:
        # (Every process ended between two looks, failures included: e.g.
        # all of them refusing the same thing at once.)
        failed = next((code for _, code in exits if code != 0), None)
      if failed is not None:
        return failed
      return 128 + self.signalled if self.signalled is not None else 0
    finally:
      for sig, handler in previous.items():
        signal.signal(sig, handler)
      for p in self.procs:
        if p.returncode is None:
          p.kill()
      if self.heartbeat_dir is not None:
        shutil.rmtree(self.heartbeat_dir, ignore_errors=True)


def _paragraphs(text: str) -> str:
  """``text``'s paragraphs (separated by blank lines), each wrapped."""
  return "\n\n".join(textwrap.fill(p, 79) for p in text.split("\n\n"))


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m zero_jax.launch",
      description=_paragraphs(
          "Run a script as NPROC processes on this machine, connected by "
          "zero_jax.distributed.initialize(), which the script must call "
          "before anything else touches JAX. With --devices-per-proc each "
          "process gets that many CPU devices (a multi-host run simulated "
          "on CPU). Output lines are prefixed with [process index]. If a "
          "process fails (exits non-zero: an exception, sys.exit(n), a "
          "signal), the others get SIGTERM, then SIGKILL after "
          "--failure-grace-period seconds, and the launcher exits with the "
          "failed process's exit code; SIGTERM/SIGINT to the launcher are "
          "forwarded to every process, SIGKILL following after "
          "--grace-period seconds."),
      epilog=_paragraphs(
          "exit status: 0 if every process exited 0; else the exit code of "
          "the first process that failed (128+N for one killed by signal "
          f"N, e.g. 137 for SIGKILL); {WATCHDOG_EXIT_CODE} if --watchdog "
          "ended the job; 128+N if the launcher got signal N, forwarded "
          "it, and every process still exited 0.\n\n"
          "example: python -m zero_jax.launch --nproc 2 "
          "--devices-per-proc 4 --watchdog 600 train.py --steps 100"),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--nproc", type=int, required=True,
                      help="number of processes to start")
  parser.add_argument("--devices-per-proc", type=int, default=None,
                      metavar="N",
                      help="give each process N CPU devices (JAX_PLATFORMS="
                      "cpu, collectives over gloo); default: each process "
                      "uses JAX's default devices")
  parser.add_argument("--port", type=int, default=None,
                      help="coordinator port on 127.0.0.1 (default: a free "
                      "one)")
  # (Three durations in seconds, each off or defaulted as its help says.)
  for flag, default, text in (
      ("--grace-period", 30.0,
       "after forwarding SIGTERM/SIGINT, wait this long before SIGKILL: the "
       "time to write a final checkpoint (default: 30)"),
      ("--failure-grace-period", None,
       "after a process failed or the watchdog fired, wait this long "
       "between SIGTERM to the others and SIGKILL (default: the smaller of "
       f"{DEFAULT_FAILURE_GRACE_SECONDS:g} and --grace-period; JAX processes "
       "ignore SIGTERM)"),
      ("--watchdog", None,
       "end a hung job: if a running process goes this long without "
       "finishing a training step (zero_jax.distributed.step_done(), which "
       "Engine.step calls; counted from the launch until the first step, so "
       "allow for start-up and compilation), print every running process's "
       "Python stack, stop the job, and exit "
       f"{WATCHDOG_EXIT_CODE} (default: off)")):
    parser.add_argument(flag, type=float, default=default,
                        metavar="SECONDS", help=text)
  parser.add_argument("-m", "--module", action="store_true",
                      help="SCRIPT is a module name, run as python -m SCRIPT")
  parser.add_argument("script", help="the training script (or module, -m)")
  parser.add_argument("args", nargs=argparse.REMAINDER,
                      help="arguments for the script")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the launcher.

  Args:
    argv: command-line arguments (default: ``sys.argv[1:]``).

  Returns:
    The exit status: 0 if every process succeeded; else the exit code of the
    first process that failed (128 + N for one killed by signal N);
    ``WATCHDOG_EXIT_CODE`` (124) if the watchdog ended the job; or, if the
    launcher was signalled and every process still exited 0, 128 + that
    signal.
  """
  parser = _parser()
  args = parser.parse_args(argv)
  _check_args(parser, args)
  argv = [sys.executable, "-c", RUNNER, "-m" if args.module else "--",
          args.script, *args.args]
  launcher = _Launcher(argv, args.nproc, args.devices_per_proc,
                       args.port or free_port(), args.grace_period,
                       args.failure_grace_period, args.watchdog)
  return launcher.run()


def _check_args(parser: argparse.ArgumentParser,
                args: argparse.Namespace) -> None:
  """Refuses numbers the launcher cannot act on (``parser.error``: exit 2,
  naming the flag). ``float`` takes ``nan`` and ``inf``: a NaN grace period
  compares false with every time, so it would never kill."""
  if args.nproc < 1:
    parser.error(f"--nproc must be >= 1, got {args.nproc}")
  if args.devices_per_proc is not None and args.devices_per_proc < 1:
    parser.error(f"--devices-per-proc must be >= 1, got "
                 f"{args.devices_per_proc}")
  if args.port is not None and not 0 <= args.port <= 65535:
    parser.error(f"--port must be a TCP port, 1 to 65535 (0: a free one), "
                 f"got {args.port}; leave it out to use a free one")
  off = "; leave it out to turn the watchdog off"
  for flag, value, fix in (
      ("--grace-period", args.grace_period, "; e.g. 30"),
      ("--failure-grace-period", args.failure_grace_period,
       "; leave it out for the default"),
      ("--watchdog", args.watchdog, off)):
    if value is not None and not math.isfinite(value):
      parser.error(f"{flag} must be a finite number of seconds, got "
                   f"{value}{fix}")
  for flag, value in (("--grace-period", args.grace_period),
                      ("--failure-grace-period", args.failure_grace_period)):
    if value is not None and value < 0:
      parser.error(f"{flag} must be >= 0, got {value:g}")
  if args.watchdog is not None and args.watchdog <= 0:
    parser.error(f"--watchdog must be > 0 (seconds without a training step), "
                 f"got {args.watchdog:g}{off}")
