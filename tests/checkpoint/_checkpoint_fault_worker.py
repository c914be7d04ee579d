"""A process for the checkpoint fault tests (see test_checkpoint_faults.py).

Usage: python -m tests.checkpoint._checkpoint_fault_worker MODE DIR

Every mode saves step 1 into DIR, keeping one checkpoint (a save of step 2
would replace it), then breaks the save of step 2 and prints what the
Checkpointer reported: ``SAVED <bool>`` for ``save``'s result and
``ERROR <type>: <message>`` for an exception, then ``DONE``. The test
measures how long the process takes to exit.

- ``disk_full``: the data files of step 2 fail to write (a file size limit,
  as a full disk would; root is subject to it too); then ``wait``, and
  ``STEPS <all_steps()>``.
- ``no_step_directory``: the step directory of step 2 cannot be created (a
  dangling link is in the way of orbax's temporary directory); then
  ``close``.
- ``never_waits``: as ``no_step_directory``, but the program exits without
  ``wait`` or ``close``.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import resource  # noqa: E402
import signal  # noqa: E402
from typing import Any, Callable  # noqa: E402

import optax  # noqa: E402

import zero_jax as zj  # noqa: E402
from tests import _models as m  # noqa: E402


def _report(fn: Callable[[], Any]) -> None:
  try:
    result = fn()
    if result is not None:
      print(f"SAVED {result}", flush=True)
  except Exception as e:  # pylint: disable=broad-except
    print(f"ERROR {type(e).__name__}: {e}", flush=True)


def main(mode: str, directory: str) -> None:
  engine = zj.Engine(m.mlp_loss, optax.adamw(1e-2),
                     zj.ZeroConfig(stage=3, min_shard_elements=0),
                     zj.make_mesh(8))
  batches = m.mlp_batches(2)
  state, _ = m.run_steps(engine, engine.init(m.mlp_params()), batches[:1])
  ckpt = zj.Checkpointer(directory, max_to_keep=1)
  ckpt.save(state, engine=engine)
  ckpt.wait()
  state, _ = m.run_steps(engine, state, batches[1:])
  if mode == "disk_full":
    # Writes past 4 KiB fail with EFBIG instead of raising SIGXFSZ. (The
    # parent reads stdout through a pipe, which the limit spares.)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE,
                       (4096, resource.RLIM_INFINITY))
  elif mode in ("no_step_directory", "never_waits"):
    # A dangling link where orbax's temporary directory goes: orbax sees no
    # stale directory to remove, and creating it fails (for root too), in
    # orbax's background thread.
    os.symlink(os.path.join(directory, "nowhere"),
               os.path.join(directory, "2.orbax-checkpoint-tmp"))
  _report(lambda: ckpt.save(state, engine=engine))
  if mode == "disk_full":
    _report(ckpt.wait)
    print(f"STEPS {ckpt.all_steps()}", flush=True)  # (as on disk)
  if mode != "never_waits":
    _report(ckpt.close)
  print("DONE", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
