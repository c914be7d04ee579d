"""Fail-fast and hang detection for multi-process runs.

Used by ``zero_jax.distributed`` (``initialize(fail_fast=True)``) and by
``python -m zero_jax.launch --watchdog`` (``Watchdog``, the launcher's side).
Importing it sets nothing up: fail-fast is armed by ``initialize`` (which
also hands ``zero_jax.train``'s hooks the probe for a published failure, so
that the processes' batch check stops waiting), and the watchdog's stack
dump by the launcher.

Failures. In a multi-process run a process that dies must not leave the
others hanging in a collective. JAX's coordination service covers part of
it: a process whose coordinator (process 0) dies aborts at once, and the
coordinator aborts everyone ``heartbeat_timeout_seconds`` after any other
process stops sending heartbeats. ``initialize`` adds what it misses (with
``fail_fast=True``): a process that ends with an uncaught exception exits at
once (JAX would first wait in its shutdown barrier for the others, until
their heartbeats time out or, if they are alive but stuck in a collective,
for the 300 s shutdown timeout) and tells the others, which exit within a
second with the same exit code and a message naming the failed process and
its error. A ``SystemExit`` with a non-zero code in the main thread counts
as a failure with that exit code (code 0 does not: that process waits in
JAX's shutdown barrier for the others, as without ``fail_fast``). Calls of
``sys.exit(n)``, ``exit(n)`` and ``quit(n)`` are seen everywhere; a bare
``raise SystemExit(n)`` only under ``python -m zero_jax.launch``, which runs
the script through a wrapper that catches it (elsewhere it exits through
JAX's barrier). A ``SystemExit`` that the script catches and swallows still
counts, unless a step is reported after it (``step_done()``, which
``Engine.step`` calls: training went on). A process killed by a signal is
for the launcher (or JAX's heartbeats) to notice.

Hangs. Under ``python -m zero_jax.launch --watchdog SECONDS`` every process
reports its training steps through ``zero_jax.distributed.step_done()``
(``zero_jax.train.step_done``; ``Engine.step`` calls it), which touches a
per-process file the launcher watches (at most once a second; without the
launcher's variable it does nothing). The launcher's runner registers
``faulthandler`` on the stack-dump signal in every process before the script
starts, so that the launcher can print a stuck process's Python stack.
"""

from __future__ import annotations

import atexit
import builtins
import os
import sys
import threading
import time
from typing import Any, Callable

from zero_jax._compat import distributed_state
from zero_jax.train import add_step_listener, set_abort_probe

# Where a failing process writes its error, then its exit code after
# ``ABORT_CODE_MARK`` unless it is 1; the other processes' fail-fast, and
# their batch check while it waits (``published_failure``), read it.
ABORT_KEY = "zero_jax/abort"
ABORT_CODE_MARK = "\x1f"  # (a character no error message holds)
_POLL_SECONDS = 1.0
# How long a failing process waits for its error to reach the coordinator.
_PUBLISH_SECONDS = 5.0
# How often the launcher's watchdog looks at the heartbeat files.
_WATCH_SECONDS = 0.5


def _client() -> Any:
  """JAX's coordination-service client, or None."""
  return getattr(distributed_state(), "client", None)


class _FailFast:
  """Ends every process of a run promptly when one of them fails.

  A process whose main thread raises, or calls ``sys.exit`` with a non-zero
  code, writes its exit code and error to the coordination service and exits
  at once; a watchdog thread in every process polls for that error and exits
  too, with the same code.

  The watchdog thread, started when fail-fast is armed, also does the
  writing: a failure is often noticed at exit (``sys.exit(3)``, seen by an
  ``atexit`` handler), when Python 3.12 refuses to start a thread ("can't
  create new thread at interpreter shutdown"; 3.11 and 3.13 allow it),
  and the coordinator must not hold the exiting process either, so the
  main thread hands the error over and waits for at most
  ``_PUBLISH_SECONDS``.
  """

  def __init__(self, client: Any, process_id: int):
    self._client = client
    self._pid = process_id
    self._stop = threading.Event()
    # Wakes the watchdog thread: to stop, or to publish ``_request``.
    self._wake = threading.Event()
    self._request: tuple[int, str] | None = None  # (code, text) to publish
    self._published = threading.Event()
    self._exit_code = 0  # non-zero: this process failed, exit with it
    # The code of the main thread's last sys.exit() (None: not called, or
    # training went on after it).
    self.exit_requested: int | None = None
    self._previous_hook = sys.excepthook
    # (owner, name) -> (original, replacement) of each exit function wrapped.
    self._exits: dict[tuple[Any, str], tuple[Any, Any]] = {}
    self._thread = threading.Thread(target=self._watch, daemon=True,
                                    name="zero_jax-fail-fast")

  def start(self) -> None:
    sys.excepthook = self._excepthook
    # SystemExit never reaches sys.excepthook, and atexit handlers cannot see
    # the exit code: only an exit function that records it can tell a
    # failing sys.exit(3) from a normal end. (A bare ``raise SystemExit(3)``
    # is seen only where the launcher runs the script: _spawn.RUNNER.)
    for owner, name in ((sys, "exit"), (builtins, "exit"), (builtins, "quit")):
      original = getattr(owner, name, None)
      if original is not None:  # (python -S has no exit() or quit())
        self._exits[owner, name] = (original, self._recording(original))
        setattr(owner, name, self._exits[owner, name][1])
    # Registered after JAX's own exit handler, so it runs first: it must
    # stop the watchdog before JAX shuts the client down.
    atexit.register(self._at_exit)
    self._thread.start()

  def stop(self) -> None:
    self._halt()
    atexit.unregister(self._at_exit)

  def _halt(self) -> None:
    self._stop.set()
    self._wake.set()
    # (Not when a publication timed out: the coordinator holds that thread,
    # and it has had its time.)
    if (self._thread.is_alive() and threading.current_thread() is not
        self._thread and (self._request is None or self._published.is_set())):
      self._thread.join(timeout=5)
    # (==, not is: every self._excepthook is a new bound-method object.)
    if sys.excepthook == self._excepthook:
      sys.excepthook = self._previous_hook
    for (owner, name), (original, wrapped) in self._exits.items():
      if getattr(owner, name, None) is wrapped:
        setattr(owner, name, original)
    self._exits.clear()

  def _watch(self) -> None:
    while True:
      self._wake.wait(_POLL_SECONDS)
      if self._request is not None:
        self._publish(*self._request)
        self._published.set()
        return  # (this process is failing: it exits on its own)
      if self._stop.is_set():
        return
      if _client() is not self._client:
        return  # jax.distributed.shutdown() was called
      try:
        message = self._client.key_value_try_get(ABORT_KEY)
      except Exception:  # pylint: disable=broad-except
        # NOT_FOUND: nobody failed. Anything else: the coordinator is gone,
        # and JAX's own error polling terminates this process.
        continue
      if self._request is not None or self._stop.is_set():
        continue  # (this process failed meanwhile: publish, or stop)
      code, text = _parse_abort(str(message))
      _stderr(f"zero_jax.distributed: {text}; stopping process "
              f"{self._pid} too.")
      self._linger()
      # The failed process's code: whichever process the launcher sees end
      # first, the job's status is the failure's.
      os._exit(code)  # pylint: disable=protected-access

  def _recording(self, exit_function: Any) -> Any:
    """``exit_function`` (``sys.exit``, ``exit``, ``quit``), remembering the
    main thread's exit code."""
    def recording_exit(*args: Any) -> None:
      try:
        exit_function(*args)
      except SystemExit as e:
        self.note_exit(e.code)
        raise
    return recording_exit

  def note_exit(self, code: Any) -> None:
    """Records ``SystemExit(code)`` raised in the main thread. (In another
    thread, SystemExit ends only that thread.)"""
    if threading.current_thread() is threading.main_thread():
      self.exit_requested = _system_exit_code(code)

  def training_went_on(self) -> None:
    """A step after a ``sys.exit`` the script caught: that call no longer
    decides the exit code (a ``zero_jax.train`` step listener)."""
    self.exit_requested = None

  def _excepthook(self, exc_type, exc, tb) -> None:
    self._previous_hook(exc_type, exc, tb)
    self._fail(1, f"process {self._pid} failed with {exc_type.__name__}: "
               f"{exc}")

  def _fail(self, code: int, text: str) -> None:
    """Marks this process failed with ``code`` and tells the others; if
    another process failed first, takes that one's code instead.

    Starts no thread (it may run at interpreter shutdown): the watchdog
    thread publishes, or, where fail-fast was never started, this one.
    """
    if self._request is not None:
      return  # (published already: the first failure's code stands)
    self._exit_code = code
    if len(text) > 1000:
      text = text[:1000] + "..."
    if self._thread.ident is None:  # (never started)
      self._request = (code, text)
      self._publish(code, text)
      return
    self._request = (code, text)
    if not self._thread.is_alive():
      return  # (jax.distributed.shutdown() ended it: nobody to tell)
    self._wake.set()
    # (Bounded: an unreachable coordinator cannot hold this process here.)
    self._published.wait(timeout=_PUBLISH_SECONDS)

  def _publish(self, code: int, text: str) -> None:
    try:
      self._client.key_value_set(ABORT_KEY, _abort_value(code, text))
      return
    except Exception:  # pylint: disable=broad-except
      pass  # another process failed first, or the coordinator is gone
    try:
      first = self._client.key_value_try_get(ABORT_KEY)
    except Exception:  # pylint: disable=broad-except
      return
    # This failure is most likely the other's consequence (a collective
    # with a process that has gone): the job's status is the first one's,
    # whichever process the launcher sees end first.
    self._exit_code, first_text = _parse_abort(str(first))
    _stderr(f"zero_jax.distributed: {first_text} before process "
            f"{self._pid} failed.")

  def _at_exit(self) -> None:
    if not self._exit_code and self.exit_requested:
      self._fail(self.exit_requested, f"process {self._pid} exited with "
                 f"code {self.exit_requested} (SystemExit)")
    self._halt()
    if self._exit_code:
      # Skip JAX's shutdown barrier: it would wait for processes that are
      # stuck in a collective with this one, until a timeout.
      _stderr(f"zero_jax.distributed: process {self._pid} exits with code "
              f"{self._exit_code} without waiting for the others "
              "(fail_fast).")
      self._linger()
      os._exit(self._exit_code)  # pylint: disable=protected-access

  def _linger(self) -> None:
    # Process 0 hosts the coordination service: give the others one more
    # poll to read the error before it disappears with this process.
    if self._pid == 0:
      time.sleep(2 * _POLL_SECONDS)


def _system_exit_code(code: Any) -> int:
  """The exit status ``SystemExit(code)`` gives, as the OS reports it."""
  if code is None:
    return 0
  if isinstance(code, int):
    return code & 0xFF  # (sys.exit(256) exits 0, sys.exit(-1) 255)
  return 1  # (Python prints a message to stderr and exits 1)


def _abort_value(code: int, text: str) -> str:
  """What a failing process publishes: its error, and its exit code unless
  that is 1 (an uncaught exception's)."""
  return text if code == 1 else f"{text}{ABORT_CODE_MARK}{code}"


def _parse_abort(value: str) -> tuple[int, str]:
  """``(exit code, text)`` of an ``_abort_value``."""
  text, mark, code = value.rpartition(ABORT_CODE_MARK)
  if mark:
    try:
      return int(code), text
    except ValueError:
      pass
  return 1, value


def _stderr(message: str) -> None:
  try:
    sys.stdout.flush()
    print(message, file=sys.stderr, flush=True)
  except Exception:  # pylint: disable=broad-except
    pass


def published_failure(client: Any) -> str | None:
  """The error another process published on failing (through ``client``,
  JAX's coordination-service client), or None: ``zero_jax.train``'s abort
  probe while fail-fast is armed."""
  try:
    value = client.key_value_try_get(ABORT_KEY)
  except Exception:  # pylint: disable=broad-except
    return None  # (NOT_FOUND: nobody failed)
  return str(value).partition(ABORT_CODE_MARK)[0]


_fail_fast: _FailFast | None = None
# Remove what the armed guard registered with ``zero_jax.train``'s hooks:
# its step listener and its abort probe.
_unregister: list[Callable[[], None]] = []


def start_fail_fast(client: Any, process_id: int) -> None:
  """Arms fail-fast for this process (``initialize(fail_fast=True)``)."""
  global _fail_fast
  _fail_fast = _FailFast(client, process_id)
  _fail_fast.start()
  # Every step resets a caught sys.exit: training went on after it.
  _unregister.append(add_step_listener(_fail_fast.training_went_on))
  # A process that waits for the others' batch stops when one has failed.
  _unregister.append(set_abort_probe(published_failure))


def stop_fail_fast() -> None:
  """Disarms fail-fast, if armed (``zero_jax.distributed.shutdown``)."""
  global _fail_fast
  while _unregister:
    _unregister.pop()()
  if _fail_fast is not None:
    _fail_fast.stop()
    _fail_fast = None


def main_exited(code: Any) -> None:
  """The launcher's runner saw the script end with ``SystemExit(code)``."""
  guard = _fail_fast
  if guard is not None:
    guard.note_exit(code)


# ------------------------------------------------- the launcher's side

class Watchdog:
  """The launcher's side of ``--watchdog``: tells when a running process
  has gone too long without a step.

  Each process touches its heartbeat file when it finishes a step
  (``zero_jax.distributed.step_done``, which ``Engine.step`` calls). The
  launcher's runner creates the file, with mtime 0, once it has registered
  the process's stack dump, before the script starts: so every launched
  process has one, whether or not it ever imports ``zero_jax``. Any later
  change of the mtime is a step. Times are the launcher's own monotonic
  clock, not the files' (which a clock change would move).
  """

  def __init__(self, limit: float, paths: list[str]):
    self.limit = limit
    self.paths = paths
    now = time.monotonic()
    self.last_step = [now] * len(paths)  # (launch counts as a step)
    self.mtimes: list[int | None] = [None] * len(paths)
    self.next_check = now

  def _look(self, now: float) -> None:
    for i, path in enumerate(self.paths):
      try:
        mtime = os.stat(path).st_mtime_ns
      except OSError:
        continue  # its runner has not started yet
      if mtime != self.mtimes[i]:
        self.mtimes[i] = mtime
        if mtime != 0:
          self.last_step[i] = now

  def has_handler(self, i: int) -> bool:
    """Whether process ``i``'s runner registered the stack dump (else the
    signal would kill it)."""
    return self.mtimes[i] is not None

  def stuck(self, running: list[int]) -> list[int]:
    """The running processes that have gone ``limit`` seconds without a
    step; checks at most every ``_WATCH_SECONDS``."""
    now = time.monotonic()
    if now < self.next_check:
      return []
    self.next_check = now + _WATCH_SECONDS
    self._look(now)
    return [i for i in running if now - self.last_step[i] >= self.limit]

  def idle(self, i: int) -> float:
    """Seconds since process ``i``'s last step (or its launch)."""
    return time.monotonic() - self.last_step[i]

