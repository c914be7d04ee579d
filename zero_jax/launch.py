"""Runs a training script as several processes on this machine.

``python -m zero_jax.launch --nproc 2 --devices-per-proc 4 train.py ARGS``
starts two copies of ``train.py ARGS`` that find each other through
``zero_jax.distributed.initialize()`` (which the script calls first). With
``--devices-per-proc N`` each process gets N CPU devices, with cross-process
collectives over gloo: a multi-host run simulated on one machine.

Like ``torchrun``: each process's output is streamed line by line, prefixed
with ``[i]``; if a process fails, the others get SIGTERM and, after a grace
period, SIGKILL, and the launcher exits with the failed process's code;
SIGTERM and SIGINT sent to the launcher go to every process. Exit status 0
means every process succeeded.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Mapping, Sequence

from zero_jax.distributed import (ENV_COORDINATOR, ENV_CPU_DEVICES,
                                  ENV_NUM_PROCESSES, ENV_PROCESS_ID)

_HOST = "127.0.0.1"
_DEVICE_COUNT_FLAG = "xla_force_host_platform_device_count"


def _free_port() -> int:
  """A TCP port nobody listens on right now (for the coordinator)."""
  with socket.socket() as s:
    s.bind((_HOST, 0))
    return s.getsockname()[1]


def _child_env(base: Mapping[str, str], process_id: int, num_processes: int,
               port: int, devices_per_proc: int | None) -> dict[str, str]:
  """The environment of process ``process_id``."""
  env = dict(base)
  env[ENV_COORDINATOR] = f"{_HOST}:{port}"
  env[ENV_NUM_PROCESSES] = str(num_processes)
  env[ENV_PROCESS_ID] = str(process_id)
  # Children write to pipes: without this, Python would hold their output
  # back in blocks instead of lines.
  env.setdefault("PYTHONUNBUFFERED", "1")
  env.pop(ENV_CPU_DEVICES, None)
  if devices_per_proc is not None:
    env[ENV_CPU_DEVICES] = str(devices_per_proc)
    env["JAX_PLATFORMS"] = "cpu"
    # An inherited device count would contradict ZERO_JAX_CPU_DEVICES.
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if _DEVICE_COUNT_FLAG not in f]
    if flags:
      env["XLA_FLAGS"] = " ".join(flags)
    else:
      env.pop("XLA_FLAGS", None)
  return env


def _exit_code(returncode: int) -> int:
  """A child's status as a shell reports it (128 + N if killed by N)."""
  return 128 - returncode if returncode < 0 else returncode


# Runs each child: if the launcher is killed (SIGKILL leaves it no chance to
# clean up), the kernel kills the child too, instead of leaving it running
# in its own session. PR_SET_PDEATHSIG survives the exec into the script.
# SIGKILL, because JAX's preemption service swallows SIGTERM in
# multi-process runs. (A trampoline, not preexec_fn: forking a process that
# runs threads, as JAX does, must not run Python code in the child.)
_TRAMPOLINE = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)  # parent died already\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n")


def _command(command: list[str]) -> list[str]:
  if not sys.platform.startswith("linux"):
    return command
  return [sys.executable, "-S", "-c", _TRAMPOLINE, str(os.getpid()),
          *command]


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
               devices_per_proc: int | None, port: int, grace: float):
    self.command = command
    self.nproc = nproc
    self.devices_per_proc = devices_per_proc
    self.port = port
    self.grace = grace
    self.procs: list[subprocess.Popen] = []
    self.signalled: int | None = None
    self.kill_at: float | None = None

  def _start(self) -> list[threading.Thread]:
    for i in range(self.nproc):
      self.procs.append(subprocess.Popen(
          _command(self.command),
          env=_child_env(os.environ, i, self.nproc, self.port,
                         self.devices_per_proc),
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

  def _signal_all(self, sig: int) -> None:
    for p in self.procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
          pass

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

  def run(self) -> int:
    # (Signal handlers can only be set from the main thread.)
    previous = ({sig: signal.signal(sig, self._on_signal)
                 for sig in (signal.SIGINT, signal.SIGTERM)}
                if threading.current_thread() is threading.main_thread()
                else {})
    try:
      threads = self._start()
      failed: int | None = None  # the exit code of the first failure
      while [p.poll() for p in self.procs].count(None):  # (poll every one)
        if failed is None:
          for i, p in enumerate(self.procs):
            if p.returncode not in (None, 0):
              failed = _exit_code(p.returncode)
              # (After a forwarded signal the others have had theirs: a
              # second SIGTERM could cut short a final checkpoint.)
              if (self.signalled is None and
                  any(q.poll() is None for q in self.procs)):
                _say(f"process {i} exited with code {failed}: terminating "
                     f"the others (SIGKILL after {self.grace:g} s)")
                self._signal_all(signal.SIGTERM)
                self.kill_at = time.monotonic() + self.grace
              break
        if self.kill_at is not None and time.monotonic() >= self.kill_at:
          _say("grace period over: killing the remaining processes")
          self._signal_all(signal.SIGKILL)
          self.kill_at = None
        time.sleep(0.05)
      for t in threads:
        t.join(timeout=5)  # (a grandchild may hold a pipe open)
      if failed is None:
        failed = next((_exit_code(p.returncode) for p in self.procs
                       if p.returncode != 0), None)
      if failed is not None:
        return failed
      return 128 + self.signalled if self.signalled is not None else 0
    finally:
      for sig, handler in previous.items():
        signal.signal(sig, handler)
      for p in self.procs:
        if p.poll() is None:
          p.kill()


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="python -m zero_jax.launch",
      description=(
          "Run a script as NPROC processes on this machine, connected by "
          "zero_jax.distributed.initialize(), which the script must call "
          "before anything else touches JAX. With --devices-per-proc each "
          "process gets that many CPU devices (a multi-host run simulated "
          "on CPU). Output lines are prefixed with [process index]. If a "
          "process fails, the others get SIGTERM, then SIGKILL after "
          "--grace-period seconds, and the launcher exits with the failed "
          "process's exit code; SIGTERM/SIGINT to the launcher are "
          "forwarded to every process."),
      epilog=("example: python -m zero_jax.launch --nproc 2 "
              "--devices-per-proc 4 train.py --steps 100"))
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
  parser.add_argument("--grace-period", type=float, default=30.0,
                      metavar="SECONDS",
                      help="after SIGTERM, wait this long before SIGKILL "
                      "(default: 30)")
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
    first process that failed (128 + N for one killed by signal N); or, if
    the launcher was signalled and every process still exited 0, 128 + that
    signal.
  """
  parser = _parser()
  args = parser.parse_args(argv)
  if args.nproc < 1:
    parser.error("--nproc must be >= 1")
  if args.devices_per_proc is not None and args.devices_per_proc < 1:
    parser.error("--devices-per-proc must be >= 1")
  if args.grace_period < 0:
    parser.error("--grace-period must be >= 0")
  command = ([sys.executable, "-m", args.script] if args.module else
             [sys.executable, args.script]) + list(args.args)
  launcher = _Launcher(command, args.nproc, args.devices_per_proc,
                       args.port or _free_port(), args.grace_period)
  return launcher.run()


if __name__ == "__main__":
  sys.exit(main())
