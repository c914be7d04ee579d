"""SIGTERM held for a training loop that asks for it: the Checkpointer's
preemption signal in a single-process run."""

from __future__ import annotations

import os
import signal
import threading


class Sigterm:
  """Catches SIGTERM (when ``install``, from the main thread) and holds it
  for a loop that polls; a loop that never polls, or a second SIGTERM,
  terminates the process as it would have without it.

  Args:
    install: whether to install the handler.
  """

  def __init__(self, install: bool):
    self._seen = threading.Event()
    self._polled = False
    self._previous = None
    self._installed = install
    if install:
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

  def _on_sigterm(self, signum, frame) -> None:
    # Deferred only for a loop that asks (``poll``); otherwise, or on a
    # second SIGTERM, the process terminates as it would have.
    if self._polled and not self._seen.is_set():
      self._seen.set()
      return
    previous = self._previous
    if callable(previous):
      previous(signum, frame)
      return
    signal.signal(signal.SIGTERM, previous or signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)

  def poll(self) -> bool:
    """Whether SIGTERM came (from now on it is held for the caller)."""
    self._polled = True
    return self._seen.is_set()

  def uninstall(self) -> None:
    """Gives SIGTERM back to the handler before this one."""
    if self._installed:
      signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
      self._installed = False
