"""What the compile-only benchmarks share: their markdown report."""

from __future__ import annotations


def emit(text: str, out: str | None = None) -> None:
  """Prints the report ``text`` and, given ``out``, writes it there."""
  print(text)
  if out:
    with open(out, "w", encoding="utf-8") as f:
      f.write(text)
