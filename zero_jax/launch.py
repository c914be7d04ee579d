"""``python -m zero_jax.launch``: runs a training script as several
processes on this machine (``zero_jax.distributed``'s launcher)."""

import sys

from zero_jax.distributed import launch_main as main

if __name__ == "__main__":
  sys.exit(main())
