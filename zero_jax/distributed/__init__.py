"""Multi-process runs: JAX's distributed runtime, each process's slice of
the batch, fail-fast and hang detection, and the launcher
(``python -m zero_jax.launch``).

Importing it sets nothing up in the process: ``initialize`` arms fail-fast,
and the launcher's runner registers the watchdog's stack dump.
"""

from zero_jax.distributed._runtime import (initialize, is_main_process,
                                           local_batch, process_batch_slice,
                                           shutdown)
from zero_jax.distributed._launcher import main as launch_main
from zero_jax.train import step_done

__all__ = [
    "initialize",
    "is_main_process",
    "launch_main",
    "local_batch",
    "process_batch_slice",
    "shutdown",
    "step_done",
]
