"""``python -m zero_jax.estimate``: per-device memory and communication of
each ZeRO stage, from the shell (``zero_jax.analysis``'s command line,
handed ``zero_jax.models`` so that ``--compile`` builds the reference
GPT)."""

from __future__ import annotations

import sys
from typing import Sequence

from zero_jax import analysis, models


def main(argv: Sequence[str] | None = None) -> int:
  """``zero_jax.analysis.main`` with the reference GPT to compile."""
  return analysis.main(argv, gpt=models)


if __name__ == "__main__":
  sys.exit(main())
