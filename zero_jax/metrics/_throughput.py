"""Throughput and MFU: tokens per second, step time and model FLOPs
utilization, measured on the host between steps, and the peak FLOP/s of
known accelerators."""

from __future__ import annotations

import re
import time

import jax


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
