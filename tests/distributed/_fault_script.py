"""One process of a two-process run that goes wrong (see
test_launch_faults.py).

Usage, from the repository root::

  python -m zero_jax.launch --nproc 2 --devices-per-proc 1 \\
      tests/distributed/_fault_script.py MODE

Both processes take a few "steps" (a cross-process sum, then
``distributed.step_done()``, as ``Engine.step`` would), then process 1
misbehaves while process 0 keeps stepping:

* ``exit``: process 1 calls ``sys.exit(3)``;
* ``raise``: process 1 raises ``SystemExit(3)`` (no exit function called);
* ``hang``: process 1 hangs in ``hang_here()`` (a sleep);
* ``kill``: process 1 kills itself with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import sys
import time

# Run as a script, this file's directory is on sys.path, not the root that
# holds the zero_jax package (when it is not installed).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from zero_jax import distributed  # noqa: E402

distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

# Steps before process 1 misbehaves; then process 0 steps on for at most
# this long (a hang that nothing ends fails the test by its timeout).
STEPS = 3
TIMEOUT_SECONDS = 600


def step(i: int) -> None:
  """A collective over both processes, then the step report."""
  total = multihost_utils.process_allgather(jnp.array([i]), tiled=True)
  assert [int(x) for x in total] == [i, i], total
  distributed.step_done()


def hang_here() -> None:
  """Process 1's hang, by a name the test finds in the stack dump."""
  time.sleep(10**6)


def main(mode: str) -> None:
  assert jax.process_count() == 2, jax.process_count()
  for i in range(STEPS):
    step(i)
  print(f"process {jax.process_index()} took {STEPS} steps", flush=True)
  if jax.process_index() == 1:
    if mode == "exit":
      sys.exit(3)
    elif mode == "raise":
      raise SystemExit(3)
    elif mode == "hang":
      hang_here()
    elif mode == "kill":
      os.kill(os.getpid(), signal.SIGKILL)
    else:
      raise SystemExit(f"unknown mode {mode!r}")
  deadline = time.monotonic() + TIMEOUT_SECONDS
  i = STEPS
  while time.monotonic() < deadline:
    step(i)  # (blocks in the collective once process 1 is gone or stuck)
    i += 1


if __name__ == "__main__":
  main(sys.argv[1])
