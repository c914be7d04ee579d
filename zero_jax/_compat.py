"""Everything that differs between the supported jax versions (0.10 to 0.12).

The rest of the library calls these helpers and never tests
``jax.__version__`` itself.
"""

from __future__ import annotations

from typing import Any

import jax


def varying_axes(x: Any) -> frozenset[str]:
  """The mesh axes ``x`` varies over inside ``shard_map`` (its type's
  ``manual_axis_type.varying``; ``vma`` in some versions)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))
