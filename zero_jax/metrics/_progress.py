"""Host-side logging of training metrics: a progress line and JSON lines.

``ProgressBar`` renders one line per update (in place on a terminal);
``JsonlLogger`` appends one JSON object per call; ``to_python`` fetches a
step's metrics (jax arrays, nested) as Python values for either, with one
``jax.device_get``. All three are re-exported by ``zero_jax.metrics``, next
to the throughput and MFU they usually print.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Callable, Mapping, TextIO

import jax
import jax.numpy as jnp
import numpy as np


def _scalar(x: Any) -> Any:
  """One host leaf as a Python scalar (0-d) or nested list (n-d)."""
  if isinstance(x, (bool, int, float, str)) or x is None:
    return x
  try:
    arr = np.asarray(x)
  except Exception:  # pylint: disable=broad-except
    return x
  if arr.dtype == np.bool_:
    return arr.tolist()
  if jnp.issubdtype(arr.dtype, jnp.integer):
    return arr.astype(np.int64).tolist()
  if jnp.issubdtype(arr.dtype, jnp.floating):  # includes bfloat16
    return arr.astype(np.float64).tolist()
  return arr.tolist()


def to_python(metrics: Mapping[str, Any]) -> dict[str, Any]:
  """Metrics (jax arrays, numpy and Python values, nested) as Python values.

  All jax arrays are fetched with one ``jax.device_get``, so this waits for
  the step that produced them. 0-d arrays become ``bool``, ``int`` or
  ``float`` (bfloat16 included); larger arrays become nested lists; nested
  mappings stay nested, in their order, with ``str`` keys; tuples become
  lists; strings and None pass through.

  Args:
    metrics: a mapping of name to value.

  Returns:
    A new dict.
  """
  arrays = []

  def collect(x):
    if isinstance(x, Mapping):
      for v in x.values():
        collect(v)
    elif isinstance(x, (list, tuple)):
      for v in x:
        collect(v)
    elif isinstance(x, jax.Array):
      arrays.append(x)

  collect(metrics)
  fetched = iter(jax.device_get(arrays))

  def build(x):
    if isinstance(x, Mapping):
      return {str(k): build(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
      return [build(v) for v in x]
    if isinstance(x, jax.Array):
      return _scalar(next(fetched))
    return _scalar(x)

  return build(metrics)


def _format_eta(seconds: float) -> str:
  s = int(round(seconds))
  if s < 60:
    return f"{s}s"
  if s < 3600:
    return f"{s // 60}m{s % 60:02d}s"
  return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _format_field(key: str, value: Any) -> str | None:
  """``"name value"`` for the progress line; None leaves the field out."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return f"{key} {value}"
  if isinstance(value, float) and not math.isfinite(value):
    return f"{key} {value}"
  if key == "tokens_per_second":
    return f"{value:,.0f} tok/s"
  if key in ("lr", "learning_rate"):
    return f"lr {value:.2e}"
  if key == "mfu":
    return f"mfu {100 * value:.1f}%"
  if key == "grad_norm":
    return f"grad_norm {value:.3f}"
  if key == "loss_scale":
    return f"loss_scale {value:.0f}"
  if key == "step_time":
    return f"{value:.3f} s/step"
  if key == "loss" or key.endswith("_loss"):
    return f"{key} {value:.4f}"
  if isinstance(value, int):
    return f"{key} {value:,}"
  return f"{key} {value:.4g}"


class ProgressBar:
  """A dependency-free progress line for a training loop.

  ``update(step, loss=..., lr=...)`` renders
  ``step 40/200 [######........................] 20% | loss 2.3412 |
  18,500 tok/s | eta 12s``. On a terminal (``stream.isatty()``) one line is
  redrawn in place with ``'\\r'`` at every update; otherwise (CI logs, files)
  a plain line is printed every ``every`` steps and at the last step, and
  the other updates cost nothing (their fields are not even fetched).

  Known fields are formatted for reading: ``loss`` (and ``*_loss``) with 4
  decimals, ``tokens_per_second`` as ``18,500 tok/s``, ``lr`` as ``3.00e-04``,
  ``mfu`` as a percentage, ``grad_norm`` with 3 decimals, ``loss_scale`` as
  an integer, ``step_time`` as ``0.123 s/step``; other floats with 4
  significant digits. None values are left out. The ETA comes from the rate
  of steps observed since the first update (which so excludes compilation).

  Use as a context manager, or call ``close()`` to end the line.
  """

  def __init__(self, total: int, *, stream: TextIO | None = None,
               width: int = 30, every: int = 1,
               clock: Callable[[], float] = time.perf_counter):
    """Creates the bar.

    Args:
      total: the last step.
      stream: where to write; None is ``sys.stderr`` (looked up now).
      width: characters inside the brackets.
      every: without a terminal, print every this many steps (and the last).
      clock: seconds on a fixed clock, for the ETA (tests pass a fake).
    """
    if total < 1 or width < 1 or every < 1:
      raise ValueError(f"need total, width, every >= 1, got {total}, "
                       f"{width}, {every}")
    self.total = total
    self.stream = sys.stderr if stream is None else stream
    self.width = width
    self.every = every
    self._clock = clock
    isatty = getattr(self.stream, "isatty", None)
    self._tty = bool(isatty()) if callable(isatty) else False
    self._first: tuple[int, float] | None = None   # (step, time)
    self._drawn = 0      # length of the line on screen (tty), 0 if none

  def _eta(self, step: int, now: float) -> float | None:
    if self._first is None:
      return None
    step0, t0 = self._first
    if step <= step0 or now <= t0:
      return None
    rate = (step - step0) / (now - t0)
    return max(self.total - step, 0) / rate

  def render(self, step: int, fields: Mapping[str, Any],
             eta: float | None = None) -> str:
    """The progress text for ``step`` (already-fetched ``fields``)."""
    frac = min(max(step / self.total, 0.0), 1.0)
    filled = int(self.width * frac)
    bar = "#" * filled + "." * (self.width - filled)
    parts = [f"step {step}/{self.total} [{bar}] {int(100 * frac)}%"]
    for key, value in fields.items():
      text = _format_field(key, value)
      if text is not None:
        parts.append(text)
    if eta is not None and step < self.total:
      parts.append(f"eta {_format_eta(eta)}")
    return " | ".join(parts)

  def update(self, step: int, **fields: Any) -> None:
    """Shows progress after ``step`` steps (1..total).

    Args:
      step: steps completed.
      **fields: values to show (jax arrays, numpy or Python scalars).
    """
    now = self._clock()
    if self._first is None:
      self._first = (step, now)
    if not self._tty and step % self.every and step < self.total:
      return
    line = self.render(step, to_python(fields), self._eta(step, now))
    if self._tty:
      pad = max(self._drawn - len(line), 0)
      self.stream.write("\r" + line + " " * pad)
      self._drawn = len(line)
    else:
      self.stream.write(line + "\n")
    self.stream.flush()

  def close(self) -> None:
    """Ends the redrawn line (terminal only); safe to call twice."""
    if self._tty and self._drawn:
      self.stream.write("\n")
      self.stream.flush()
    self._drawn = 0

  def __enter__(self) -> ProgressBar:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  out = {}
  for key, value in d.items():
    name = f"{prefix}{key}"
    if isinstance(value, Mapping):
      out.update(_flatten(value, name + "/"))
    else:
      out[name] = value
  return out


def _json_safe(x: Any) -> Any:
  """Non-finite floats as the strings "nan", "inf", "-inf" (strict JSON)."""
  if isinstance(x, float) and not math.isfinite(x):
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
  if isinstance(x, list):
    return [_json_safe(v) for v in x]
  return x


class JsonlLogger:
  """Writes metrics as JSON lines: one object per ``log`` call.

  Each line is ``{"step": step, ...metrics}`` with the values converted by
  ``to_python`` (one ``jax.device_get`` per line). Nested mappings are
  flattened with ``/``: ``log(3, aux={"acc": 0.5})`` writes
  ``{"step": 3, "aux/acc": 0.5}``, so every line is a flat record
  (``pandas.read_json(path, lines=True)`` gives one column per metric).
  Non-finite floats are written as the strings ``"nan"``, ``"inf"`` and
  ``"-inf"`` so every line stays strict JSON. Each line is flushed as it is
  written, so a run that crashes keeps its log. The file is opened for
  appending, so a resumed run continues the same log.

  Example::

    with JsonlLogger("run/metrics.jsonl") as log:
      log.log(step, loss=out["loss"], **meter.window())
  """

  def __init__(self, path: str | os.PathLike[str]):
    """Opens ``path`` for appending, creating its directory if needed."""
    self.path = os.fspath(path)
    parent = os.path.dirname(self.path)
    if parent:
      os.makedirs(parent, exist_ok=True)
    self._file: TextIO | None = open(self.path, "a", encoding="utf-8")

  def log(self, step: int, **metrics: Any) -> None:
    """Appends one line: ``step`` and ``metrics``."""
    if self._file is None:
      raise ValueError(f"JsonlLogger({self.path!r}) is closed")
    record = {"step": int(step)}
    record.update(_flatten(to_python(metrics)))
    record = {k: _json_safe(v) for k, v in record.items()}
    self._file.write(json.dumps(record, allow_nan=False) + "\n")
    self._file.flush()

  def close(self) -> None:
    """Closes the file; safe to call twice."""
    if self._file is not None:
      self._file.close()
      self._file = None

  def __enter__(self) -> JsonlLogger:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
