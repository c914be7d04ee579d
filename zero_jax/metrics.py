"""Host-side training metrics: tokens/s, MFU, a progress bar, JSON-lines logs.

Everything here runs on the host between steps; nothing is traced or
compiled. Values that come off devices (the loss, the gradient norm, ...) are
fetched with a single ``jax.device_get`` per call, and only when they are
actually written out.

Example::

  fpt = transformer_flops_per_token(n_params, n_layers, seq_len, d_model)
  meter = Throughput(global_batch * seq_len, flops_per_token=fpt,
                     peak=peak_flops(), num_devices=jax.device_count())
  with ProgressBar(num_steps, every=10) as bar, JsonlLogger("log.jsonl") as log:
    for step in range(1, num_steps + 1):
      state, out = engine.step(state, next(batches))
      jax.block_until_ready(out)           # the step has really finished
      meter.update()
      if step % 10 == 0 or step == num_steps:
        rates = meter.window()             # tokens/s, step_time, mfu
        log.log(step, loss=out["loss"], **rates)
        bar.update(step, loss=out["loss"], **rates)
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from typing import Any, Callable, Mapping, TextIO

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "JsonlLogger",
    "PEAK_FLOPS",
    "ProgressBar",
    "Throughput",
    "mfu",
    "peak_flops",
    "to_python",
    "transformer_flops_per_token",
]

# Dense (no 2:4 sparsity) bf16 tensor-core peak FLOP/s per device, keyed by a
# whole-word substring of ``jax.Device.device_kind``; ``peak_flops`` picks the
# longest key that matches. Sources: vendor datasheets. NVIDIA publishes most
# of these figures "with sparsity"; the values here are half of those. V100
# has no bf16: its fp16 tensor-core figure (SXM2) is used.
#   H100 / H200: NVIDIA H100 and H200 Tensor Core GPU datasheets.
#   GH200: NVIDIA GH200 Grace Hopper Superchip datasheet (per GPU).
#   A100, A10, L4, L40, L40S, V100: the respective NVIDIA datasheets.
#   A10G: NVIDIA A10G datasheet for AWS (70 TF dense, not the A10's 125).
#   TPU v4, v5e, v5p, v6e (Trillium): Google Cloud TPU system architecture
#   pages (bf16 peak per chip).
PEAK_FLOPS: dict[str, float] = {
    "H100": 989e12,            # fallback for H100 variants: the SXM figure
    "H100 80GB HBM3": 989e12,  # SXM
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200": 989e12,
    "H200 NVL": 835e12,
    "GH200": 989e12,
    "A100": 312e12,
    "A10": 125e12,
    "A10G": 70e12,
    "L4": 121e12,
    "L40": 181e12,
    "L40S": 362e12,
    "V100": 125e12,            # fp16 tensor core (no bf16 on Volta)
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5": 459e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
}


def peak_flops(device: jax.Device | str | None = None) -> float | None:
  """Dense bf16 peak FLOP/s of one device, from ``PEAK_FLOPS``.

  The most specific entry wins: of the keys that occur in the device kind
  as whole words (case-insensitive; ``"A100"`` is not found in
  ``"RTX A1000"``), the longest. So ``"NVIDIA H100 PCIe"`` gets the PCIe
  figure, ``"NVIDIA H100 80GB HBM3"`` the SXM one and
  ``"NVIDIA GH200 480GB"`` the GH200 one, not H200's.

  Args:
    device: a device, a ``device_kind`` string, or None for
      ``jax.devices()[0]``.

  Returns:
    FLOP/s, or None for CPUs and unknown kinds (MFU is then not reported).
  """
  if device is None:
    device = jax.devices()[0]
  if isinstance(device, str):
    kind = device
  else:
    if device.platform == "cpu":
      return None
    kind = device.device_kind
  matches = [key for key in PEAK_FLOPS
             if re.search(rf"(?<![a-z0-9]){re.escape(key)}(?![a-z0-9])",
                          kind, flags=re.IGNORECASE)]
  if not matches:
    return None
  return PEAK_FLOPS[max(matches, key=len)]


def transformer_flops_per_token(n_params: int, n_layers: int, seq_len: int,
                                d_model: int, *,
                                causal: bool = False) -> float:
  """Training FLOPs per token of a decoder-style transformer.

  ``6 * n_params + 12 * n_layers * seq_len * d_model`` (PaLM, Chowdhery et
  al. 2022, appendix B). ``6 * n_params`` is the weight matmuls: 2 FLOPs per
  multiply-add, times 3 for forward plus backward (gradients with respect to
  activations and to weights). The second term is attention's two
  sequence-length matmuls (``Q K^T`` and ``scores V``) in forward and
  backward, with ``n_heads * head_dim == d_model``.

  These are *model* FLOPs: rematerialization's recomputed forward is not
  counted, so the resulting ``mfu`` is model FLOPs utilisation, not hardware
  FLOPs utilisation. Element-wise work (norms, softmax, activations) is left
  out. ``n_params`` should hold every weight used in a matmul: an untied
  input embedding is a gather and is often left out; a tied one is counted
  once (it is the output projection).

  Args:
    n_params: parameters taking part in matmuls.
    n_layers: transformer layers.
    seq_len: tokens per sequence.
    d_model: model width (``n_heads * head_dim``).
    causal: False (the default, PaLM's convention, so results compare with
      published MFU figures) counts the full attention score matrix. True
      halves the attention term: the masked half is work a causal kernel
      skips.

  Returns:
    FLOPs per token for one training step (forward and backward).
  """
  attention = 12.0 * n_layers * seq_len * d_model
  if causal:
    attention /= 2
  return 6.0 * n_params + attention


def mfu(flops_per_token: float, tokens_per_second: float,
        peak: float | None, num_devices: int = 1) -> float | None:
  """Model FLOPs utilisation: achieved FLOP/s over ``num_devices * peak``.

  Args:
    flops_per_token: training FLOPs per token (see
      ``transformer_flops_per_token``).
    tokens_per_second: tokens processed per second by all ``num_devices``.
    peak: peak FLOP/s of one device (see ``peak_flops``), or None.
    num_devices: devices that processed those tokens.

  Returns:
    A fraction (1.0 is the peak), or None when ``peak`` is None.
  """
  if peak is None:
    return None
  if peak <= 0 or num_devices < 1:
    raise ValueError(f"need peak > 0 and num_devices >= 1, got {peak} and "
                     f"{num_devices}")
  return flops_per_token * tokens_per_second / (num_devices * peak)


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


class Throughput:
  """Tokens/s and MFU of a training loop, measured on the host.

  Call ``update()`` once after each step has completed: block on the step's
  outputs first (``jax.block_until_ready``), or the time measured is only
  dispatch. The first ``skip_first`` steps (compilation) are not measured:
  timing starts when the last of them completes. With ``skip_first=0``
  timing starts at ``start()``, or at construction if it is never called.

  Two views of the same measurements:

  - the properties (``tokens_per_second``, ``step_time``, ``mfu``,
    ``elapsed``) cover every measured step so far;
  - ``window()`` covers the steps since the previous ``window()`` call
    (or since timing started) and starts a new window; ``rates()`` reads
    the current window without starting a new one.

  ``tokens_per_step`` and ``num_devices`` must describe the same devices:
  either the global batch's tokens and ``jax.device_count()``, or this
  process's tokens and ``jax.local_device_count()``.

  Attributes:
    tokens_per_step: tokens processed per step.
    flops_per_token: training FLOPs per token, or None (no MFU).
    peak: peak FLOP/s of one device, or None (no MFU).
    num_devices: devices sharing ``peak``.
    skip_first: warm-up steps left out of every rate.
    steps: ``update()`` calls so far, warm-up included.
  """

  def __init__(self, tokens_per_step: int, *,
               flops_per_token: float | None = None,
               peak: float | None = None, num_devices: int = 1,
               skip_first: int = 1):
    if tokens_per_step <= 0:
      raise ValueError(f"tokens_per_step must be > 0, got {tokens_per_step}")
    if skip_first < 0:
      raise ValueError(f"skip_first must be >= 0, got {skip_first}")
    if num_devices < 1:
      raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    self.tokens_per_step = tokens_per_step
    self.flops_per_token = flops_per_token
    self.peak = peak
    self.num_devices = num_devices
    self.skip_first = skip_first
    self.steps = 0
    self._t0: float | None = None      # when timing started
    self._last: float | None = None    # the latest measured update
    self._window_t0: float | None = None
    self._window_steps = 0
    if skip_first == 0:
      self.start()

  def start(self, now: float | None = None) -> None:
    """Starts timing now (only meaningful with ``skip_first=0``)."""
    now = time.perf_counter() if now is None else now
    self._t0 = self._window_t0 = now

  def update(self, now: float | None = None) -> None:
    """Records that one more step has completed.

    Args:
      now: the time, in seconds, on any fixed clock; None reads
        ``time.perf_counter()``.
    """
    now = time.perf_counter() if now is None else now
    self.steps += 1
    if self.steps <= self.skip_first:
      if self.steps == self.skip_first:
        self.start(now)
      return
    self._last = now
    self._window_steps += 1

  @property
  def measured_steps(self) -> int:
    """Steps that count towards the rates (warm-up excluded)."""
    return max(self.steps - self.skip_first, 0)

  @property
  def elapsed(self) -> float:
    """Seconds from the start of timing to the latest step (warm-up not
    included); 0.0 before the first measured step."""
    if self._last is None or self._t0 is None:
      return 0.0
    return self._last - self._t0

  def _tps(self, steps: int, seconds: float) -> float | None:
    if steps == 0 or seconds <= 0:
      return None
    return steps * self.tokens_per_step / seconds

  def _mfu(self, tps: float | None) -> float | None:
    if tps is None or self.flops_per_token is None:
      return None
    return mfu(self.flops_per_token, tps, self.peak, self.num_devices)

  @property
  def tokens_per_second(self) -> float | None:
    """Tokens/s over every measured step; None before the first one."""
    return self._tps(self.measured_steps, self.elapsed)

  @property
  def step_time(self) -> float | None:
    """Mean seconds per measured step; None before the first one."""
    n = self.measured_steps
    return self.elapsed / n if n else None

  @property
  def mfu(self) -> float | None:
    """MFU over every measured step; None without ``flops_per_token`` and
    ``peak``, or before the first measured step."""
    return self._mfu(self.tokens_per_second)

  def rates(self) -> dict[str, float]:
    """The current window's rates, leaving the window open.

    Returns:
      ``{"tokens_per_second", "step_time"}`` plus ``"mfu"`` when it is
      known; empty when the window holds no measured step. The keys are
      those ``ProgressBar`` formats, so the dict can be splatted into
      ``ProgressBar.update`` or ``JsonlLogger.log``.
    """
    if not self._window_steps or self._last is None:
      return {}
    seconds = self._last - self._window_t0
    tps = self._tps(self._window_steps, seconds)
    if tps is None:
      return {}
    out = {"tokens_per_second": tps,
           "step_time": seconds / self._window_steps}
    m = self._mfu(tps)
    if m is not None:
      out["mfu"] = m
    return out

  def window(self) -> dict[str, float]:
    """The current window's rates (see ``rates``); then starts a new one."""
    out = self.rates()
    if self._window_steps and self._last is not None:
      self._window_t0 = self._last
      self._window_steps = 0
    return out


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
