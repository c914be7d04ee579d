"""How ``python -m zero_jax.launch`` starts each process: its environment,
the trampoline that ties it to the launcher's life, and the runner that
runs the script and sees how it ends.

The launcher itself (supervision, output, signals, the command line) is
``_launcher.py``.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from typing import Mapping

from zero_jax.distributed._runtime import (ENV_COORDINATOR, ENV_CPU_DEVICES,
                                           ENV_NUM_PROCESSES, ENV_PROCESS_ID)
from zero_jax.train._hooks import ENV_HEARTBEAT_FILE

HOST = "127.0.0.1"
_DEVICE_COUNT_FLAG = "xla_force_host_platform_device_count"
# The signal on which a process started with --watchdog prints every
# thread's Python stack to its stderr (registered by RUNNER).
STACK_DUMP_SIGNAL = signal.SIGUSR1


def free_port() -> int:
  """A TCP port nobody listens on right now (for the coordinator)."""
  with socket.socket() as s:
    s.bind((HOST, 0))
    return s.getsockname()[1]


def child_env(base: Mapping[str, str], process_id: int, num_processes: int,
              port: int, devices_per_proc: int | None,
              heartbeat_file: str | None = None) -> dict[str, str]:
  """The environment of process ``process_id``.

  Args:
    base: the launcher's environment.
    process_id: the process's index.
    num_processes: how many processes the launcher starts.
    port: the coordinator's port on ``HOST``.
    devices_per_proc: CPU devices per process (None: JAX's default
      devices).
    heartbeat_file: the file the process touches at each step
      (``--watchdog``), or None.

  Returns:
    The environment.
  """
  env = dict(base)
  env[ENV_COORDINATOR] = f"{HOST}:{port}"
  env[ENV_NUM_PROCESSES] = str(num_processes)
  env[ENV_PROCESS_ID] = str(process_id)
  # (Inherited from a launcher that launched this one: not ours to touch.)
  env.pop(ENV_HEARTBEAT_FILE, None)
  if heartbeat_file is not None:
    env[ENV_HEARTBEAT_FILE] = heartbeat_file
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


# Runs each child: if the launcher is killed (SIGKILL leaves it no chance to
# clean up), the kernel kills the child too, instead of leaving it running
# in its own session. PR_SET_PDEATHSIG survives the exec into the script.
# SIGKILL, because JAX's preemption service swallows SIGTERM in
# multi-process runs. (A trampoline, not preexec_fn: forking a process that
# runs threads, as JAX does, must not run Python code in the child.)
TRAMPOLINE = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)  # parent died already\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n")


# Runs the script (or module, -m) as Python would, but sees how it ends: a
# SystemExit from any route (sys.exit, exit(), raise SystemExit) tells
# zero_jax.distributed's fail-fast the exit code (main_exited), which atexit
# cannot learn. Under --watchdog (ENV_HEARTBEAT_FILE set) it first registers
# the stack dump, so that every process has one, whether or not the script
# ever imports zero_jax; then it creates the heartbeat file with mtime 0,
# which tells the launcher "running, no step yet, stack dump registered".
# O_EXCL: a process that inherits the variable and runs this again must not
# reset the file. (Created even without a stack dump, which only a process
# without stderr lacks: else its steps would go unseen.)
# Once the script has ended well, a script that used JAX but never started
# its distributed runtime (zero_jax.distributed.initialize()) ran alone, as
# if it were the only process: an error (alone_at_exit of
# zero_jax/train/_agreement.py; Engine.step says so at the first step
# already). Skipped where the script's Python cannot import zero_jax.
# Inline and standard library only until the script has run, not a module of
# this package: importing zero_jax.distributed would import JAX before the
# script sets its flags.
RUNNER = (
    "import os, runpy, sys\n"
    f"beat = os.environ.get({ENV_HEARTBEAT_FILE!r}, '').strip()\n"
    "if beat:\n"
    "  import faulthandler\n"
    "  try:\n"
    f"    faulthandler.register({int(STACK_DUMP_SIGNAL)}, file=sys.stderr,\n"
    "                          all_threads=True, chain=False)\n"
    "  except (AttributeError, ValueError, OSError, RuntimeError):\n"
    "    pass  # (no usable stderr file descriptor: no stacks)\n"
    "  try:\n"
    "    os.close(os.open(beat, os.O_CREAT | os.O_EXCL | os.O_WRONLY))\n"
    "    os.utime(beat, ns=(0, 0))\n"
    "  except OSError:\n"
    "    pass\n"
    "mode, target = sys.argv[1], sys.argv[2]\n"
    "sys.argv = sys.argv[2:]\n"
    "if mode == '-m':\n"
    "  sys.path[0] = os.getcwd()\n"
    "  run = lambda: runpy.run_module(target, run_name='__main__',\n"
    "                                 alter_sys=True)\n"
    "else:\n"
    "  sys.path[0] = os.path.dirname(os.path.realpath(target))\n"
    "  run = lambda: runpy.run_path(target, run_name='__main__')\n"
    "ended = None\n"
    "try:\n"
    "  run()\n"
    "except SystemExit as e:\n"
    "  d = sys.modules.get('zero_jax.distributed._failfast')\n"
    "  if d is not None:\n"
    "    d.main_exited(e.code)\n"
    "  if e.code not in (None, 0):\n"
    "    raise\n"
    "  ended = e\n"
    "if 'jax' in sys.modules:\n"
    "  try:\n"
    "    from zero_jax.train._agreement import alone_at_exit\n"
    "  except ImportError:\n"
    "    alone_at_exit = lambda: None\n"
    "  error = alone_at_exit()\n"
    "  if error:\n"
    "    sys.exit('zero_jax.launch: ' + error)\n"
    "if ended is not None:\n"
    "  raise ended\n")


def tied_command(argv: list[str]) -> list[str]:
  """``argv`` behind the trampoline (Linux), so that the process dies with
  the launcher."""
  if not sys.platform.startswith("linux"):
    return argv
  return [sys.executable, "-S", "-c", TRAMPOLINE, str(os.getpid()), *argv]
