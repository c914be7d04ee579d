"""``python -m zero_jax.estimate``: per-device memory and communication of
each ZeRO stage, from the shell (``zero_jax.analysis``'s command line)."""

import sys

from zero_jax.analysis import main

if __name__ == "__main__":
  sys.exit(main())
