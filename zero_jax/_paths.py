"""Pytree key paths as text, written one way everywhere: in plans,
``describe()``, the blocks found in a parameter tree and checkpoint
errors."""

from __future__ import annotations

from typing import Any, Sequence


def key_name(entry: Any) -> str:
  """One entry of a key path as text: a dict key, a sequence index, an
  attribute or a flattened index, as the entry itself holds it."""
  for attr in ("key", "idx", "name"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def path_keys(path: Sequence[Any]) -> tuple[str, ...]:
  """A pytree key path's entries as text. (The ``value`` attribute of a
  Flax ``Variable`` box is left out: the value is the leaf.)"""
  return tuple(key_name(k) for k in path
               if not (hasattr(k, "name") and not hasattr(k, "key")
                       and k.name == "value"))


def path_str(path: Sequence[Any]) -> str:
  """A readable path such as ``layers/w1`` for a pytree key path
  (``path_keys`` joined)."""
  return "/".join(path_keys(path)) or "<root>"
