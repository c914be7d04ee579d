"""Host-side metrics: peak lookup, FLOPs, MFU, meters, progress bar, logs."""

import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zero_jax import metrics as zm
from zero_jax.metrics._progress import to_python
from zero_jax.metrics._throughput import PEAK_FLOPS

# ------------------------------------------------------------- peak lookup


@pytest.mark.parametrize("kind,expected", [
    ("NVIDIA H100 80GB HBM3", 989e12),
    ("NVIDIA H100 PCIe", 756e12),
    ("nvidia h100 pcie", 756e12),          # case-insensitive
    ("NVIDIA H100", 989e12),               # plain fallback
    ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA GH200 480GB", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A10G", 70e12),
    ("NVIDIA A10", 125e12),
    ("NVIDIA L4", 121e12),
    ("NVIDIA L40", 181e12),
    ("NVIDIA L40S", 362e12),
    ("Tesla V100-SXM2-16GB", 125e12),
    ("TPU v4", 275e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v5", 459e12),
    ("TPU v5p", 459e12),
    ("TPU v6 lite", 918e12),
    ("Quadro RTX 6000", None),
    ("NVIDIA RTX A1000", None),            # "A100" only as a whole word
    ("cpu", None),
])
def test_peak_flops_by_kind(kind, expected):
  assert zm.peak_flops(kind) == expected


def test_peak_flops_most_specific_wins():
  # GH200 and H200 carry the same figure, so check the key that was chosen
  # by making them differ.
  table = dict(PEAK_FLOPS)
  try:
    PEAK_FLOPS["GH200"] = 1.0
    assert zm.peak_flops("NVIDIA GH200 480GB") == 1.0
    assert zm.peak_flops("NVIDIA H200") == 989e12
  finally:
    PEAK_FLOPS.clear()
    PEAK_FLOPS.update(table)


def test_peak_flops_on_cpu_is_none():
  assert zm.peak_flops() is None
  assert zm.peak_flops(jax.devices()[0]) is None


# ------------------------------------------------------------ flops and mfu


def test_transformer_flops_per_token():
  n, layers, seq, d = 124_000_000, 12, 1024, 768
  attention = 12 * layers * seq * d          # 113,246,208
  assert zm.transformer_flops_per_token(n, layers, seq, d) == (
      744_000_000 + attention)
  assert zm.transformer_flops_per_token(n, layers, seq, d, causal=True) == (
      744_000_000 + attention / 2)


def test_mfu():
  # 1e9 FLOPs/token * 1e5 tok/s = 1e14 FLOP/s over 4 devices of 1e14.
  assert zm.mfu(1e9, 1e5, 1e14, num_devices=4) == pytest.approx(0.25)
  assert zm.mfu(1e9, 1e5, 1e14) == pytest.approx(1.0)
  assert zm.mfu(1e9, 1e5, None, num_devices=4) is None
  with pytest.raises(ValueError):
    zm.mfu(1e9, 1e5, 1e14, num_devices=0)


# --------------------------------------------------------------- throughput


def test_throughput_skips_the_first_step():
  meter = zm.Throughput(1000, flops_per_token=1e9, peak=1e13, num_devices=2)
  assert meter.tokens_per_second is None and meter.mfu is None
  meter.update(now=100.0)                  # compile: slow and not measured
  assert meter.tokens_per_second is None and meter.elapsed == 0.0
  assert meter.window() == {}
  for t in (100.5, 101.0, 101.5, 102.0):
    meter.update(now=t)
  assert meter.steps == 5 and meter.measured_steps == 4
  assert meter.elapsed == pytest.approx(2.0)
  assert meter.step_time == pytest.approx(0.5)
  assert meter.tokens_per_second == pytest.approx(2000.0)
  # 1e9 * 2000 / (2 * 1e13)
  assert meter.mfu == pytest.approx(0.1)

  window = meter.window()
  assert window == pytest.approx(
      {"tokens_per_second": 2000.0, "step_time": 0.5, "mfu": 0.1})
  assert meter.window() == {}               # nothing since
  meter.update(now=104.0)                  # one slow step: 500 tok/s
  meter.update(now=106.0)
  assert meter.rates() == pytest.approx(
      {"tokens_per_second": 500.0, "step_time": 2.0, "mfu": 0.025})
  assert meter.window()["tokens_per_second"] == pytest.approx(500.0)
  # Overall: 6 steps in 6 s.
  assert meter.tokens_per_second == pytest.approx(1000.0)


def test_throughput_without_peak_or_warmup():
  meter = zm.Throughput(10, skip_first=0)
  meter.start(now=0.0)
  meter.update(now=1.0)
  meter.update(now=2.0)
  assert meter.tokens_per_second == pytest.approx(10.0)
  assert meter.mfu is None
  assert meter.window() == pytest.approx(
      {"tokens_per_second": 10.0, "step_time": 1.0})
  no_peak = zm.Throughput(10, flops_per_token=1e6, peak=None, skip_first=0)
  no_peak.start(now=0.0)
  no_peak.update(now=1.0)
  assert no_peak.mfu is None and "mfu" not in no_peak.rates()


# ------------------------------------------------------------- progress bar


class _Clock:

  def __init__(self, step: float = 1.0):
    self.t, self.step = 0.0, step

  def __call__(self) -> float:
    self.t += self.step
    return self.t


class _Tty(io.StringIO):

  def isatty(self) -> bool:
    return True


def test_progress_bar_plain_lines():
  out = io.StringIO()
  bar = zm.ProgressBar(10, stream=out, width=10, every=3, clock=_Clock())
  for step in range(1, 11):
    bar.update(step, loss=jnp.float32(2.0 + 1.0 / step))
  bar.close()
  lines = out.getvalue().splitlines()
  assert [line.split()[1] for line in lines] == ["3/10", "6/10", "9/10",
                                                "10/10"]
  assert "\r" not in out.getvalue()
  # Steps 1..6 took one clock tick each: 4 steps left, 1 s per step.
  assert lines[1] == "step 6/10 [######....] 60% | loss 2.1667 | eta 4s"
  assert lines[-1] == "step 10/10 [##########] 100% | loss 2.1000"


def test_progress_bar_formats_fields():
  out = io.StringIO()
  bar = zm.ProgressBar(200, stream=out, width=10, clock=_Clock())
  bar.update(40, loss=np.float64(2.34123), tokens_per_second=18500.4,
             lr=jnp.asarray(3e-4), mfu=0.4123, grad_norm=1.23456,
             loss_scale=jnp.float32(65536.0), step_time=0.1234, ok=True,
             skipped=None, other=0.000123456)
  text = out.getvalue()
  assert text.startswith("step 40/200 [##........] 20% | loss 2.3412 | "
                         "18,500 tok/s | lr 3.00e-04 | mfu 41.2% | "
                         "grad_norm 1.235 | loss_scale 65536 | "
                         "0.123 s/step | ok True | other 0.0001235")
  assert "skipped" not in text


def test_progress_bar_redraws_on_a_tty():
  out = _Tty()
  with zm.ProgressBar(4, stream=out, width=4, every=100,
                      clock=_Clock(2.0)) as bar:
    bar.update(1, loss=10.0)
    bar.update(2, loss=1.0)
    bar.update(3)
  text = out.getvalue()
  assert text.count("\r") == 3 and text.endswith("\n")
  assert text.count("\n") == 1
  draws = text.rstrip("\n").split("\r")[1:]
  assert draws[0] == "step 1/4 [#...] 25% | loss 10.0000"
  assert draws[1] == "step 2/4 [##..] 50% | loss 1.0000 | eta 4s"
  # The shorter third line is padded to erase the second one.
  assert draws[2].startswith("step 3/4 [###.] 75% | eta 2s")
  assert len(draws[2]) == len(draws[1])
  assert draws[2].strip() == "step 3/4 [###.] 75% | eta 2s"


# ------------------------------------------------------------------ jsonl


def test_to_python():
  out = to_python({
      "loss": jnp.float32(1.5),
      "bf16": jnp.asarray(2.5, jnp.bfloat16),
      "n": jnp.int32(3),
      "flag": jnp.asarray(True),
      "vec": jnp.arange(3.0),
      "aux": {"acc": np.float32(0.25)},
      "name": "run",
      "none": None,
  })
  assert out == {"loss": 1.5, "bf16": 2.5, "n": 3, "flag": True,
                 "vec": [0.0, 1.0, 2.0], "aux": {"acc": 0.25},
                 "name": "run", "none": None}
  assert type(out["loss"]) is float and type(out["bf16"]) is float
  assert type(out["n"]) is int and type(out["flag"]) is bool


def test_jsonl_logger_round_trip(tmp_path):
  path = tmp_path / "run" / "metrics.jsonl"
  with zm.JsonlLogger(path) as log:
    log.log(1, loss=jnp.float32(2.5), lr=np.float64(1e-3), finite=True,
            aux={"acc": jnp.asarray(0.75)})
    log.log(jnp.int32(2), loss=float("nan"), tokens=1024)
  with zm.JsonlLogger(path) as log:         # appends
    log.log(3, loss=1.25)
  lines = path.read_text().splitlines()
  assert len(lines) == 3
  records = [json.loads(line) for line in lines]
  assert records[0] == {"step": 1, "loss": 2.5, "lr": 1e-3, "finite": True,
                        "aux/acc": 0.75}
  assert records[1] == {"step": 2, "loss": "nan", "tokens": 1024}
  assert records[2] == {"step": 3, "loss": 1.25}
  assert type(records[0]["finite"]) is bool


def test_jsonl_logger_flushes_each_line(tmp_path):
  path = tmp_path / "metrics.jsonl"
  log = zm.JsonlLogger(path)
  log.log(1, loss=1.0)
  assert json.loads(path.read_text()) == {"step": 1, "loss": 1.0}
  log.close()
  log.close()
  with pytest.raises(ValueError):
    log.log(2, loss=1.0)
