"""Multi-process runs: JAX's distributed runtime, each process's slice of
the batch, fail-fast and hang detection, and the launcher
(``python -m zero_jax.launch``).

Importing it sets nothing up in the process: ``initialize`` arms fail-fast,
and the launcher's runner registers the watchdog's stack dump.
"""

from zero_jax.distributed._runtime import (ENV_COORDINATOR, ENV_CPU_DEVICES,
                                           ENV_NUM_PROCESSES, ENV_PROCESS_ID,
                                           initialize, is_main_process,
                                           local_batch, process_batch_slice,
                                           shutdown)
from zero_jax.distributed._launcher import WATCHDOG_EXIT_CODE
from zero_jax.distributed._launcher import main as launch_main
from zero_jax.train import ENV_HEARTBEAT_FILE, step_done

__all__ = [
    "ENV_COORDINATOR",
    "ENV_CPU_DEVICES",
    "ENV_HEARTBEAT_FILE",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "WATCHDOG_EXIT_CODE",
    "initialize",
    "is_main_process",
    "launch_main",
    "local_batch",
    "process_batch_slice",
    "shutdown",
    "step_done",
]
