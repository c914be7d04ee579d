"""The host updaters alive in this process: what a checkpoint's save asks
before it reads host state that an update writes in place."""

from __future__ import annotations

from typing import Any, Callable
import weakref

import jax

# The updaters whose kernels run in the background now (``settle``).
PENDING: weakref.WeakSet = weakref.WeakSet()


# Every fused updater alive in this process (``in_place``).
ALL: weakref.WeakSet = weakref.WeakSet()


def in_place(tree: Any) -> bool:
  """Whether ``tree`` (a train state) holds host state that a fused host
  optimizer updates in place: what saves it must finish writing before
  the next update."""
  leaves = jax.tree.leaves(tree)
  return any(u.owns(x) for u in list(ALL) for x in leaves)


def settle() -> None:
  """Waits for every fused host update running in the background in this
  process: what reads host state the engine updates in place (a
  checkpoint's save) calls it first."""
  for update in list(PENDING):
    update.wait()


def hold(tree: Any, wait: Callable[[], None]) -> None:
  """Tells every host updater that something reads ``tree`` (a train
  state) until ``wait()`` returns: one that keeps it in files (the NVMe
  tier) calls ``wait`` before it overwrites them, two updates later."""
  for update in list(ALL):
    update.hold(tree, wait)
