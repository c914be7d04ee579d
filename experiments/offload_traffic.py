"""PCIe bytes per step of each offload mode, and the step time they imply.

Compiles (never runs) the reference GPT's stage-3 train step for one H100
(``zero_jax.analysis``, no GPU needed; vocabulary 50304, sequence 1024, bf16
compute, fp32 AdamW, remat full) with each offload mode, and counts the
bytes it moves between host and device memory per step
(``CompiledStep.transfers``: copies, dynamic slices and updates of host
memory in the HLO, loops counted with their trip counts; with
``update_on="host"`` also the gradients the step returns in device memory and
the compute copy it is given). From those bytes it predicts a lower bound
on the step time: the no-offload step (``--step-s``, measured on a real
H100), the link time of the bytes, and with ``update_on="host"`` the host's
update at ``--host-rate`` parameters per second; ``delay_update`` may
overlap all three, without it the host's update follows the step::

  PYTHONPATH=. python experiments/offload_traffic.py \
      [--out experiments/results/offload_traffic_h100.md]

Link speeds default to pinned copies measured on an H100 host: 32 GiB/s host
to device, 50 device to host, 52 both at once.
"""

from __future__ import annotations

import argparse
import json
import os

from zero_jax.models import compile_gpt

from _report import emit  # experiments/_report.py, beside this script

GIB = 2 ** 30
SIZES = {"1.3b": dict(layers=24, hidden=2048, heads=16),
         "125m": dict(layers=12, hidden=768, heads=12)}
MODES = {
    "no offload": {},
    "`offload_optimizer` (streamed update)": dict(offload_optimizer=True),
    "+ `offload_params`": dict(offload_optimizer=True, offload_params=True),
    "`update_on=\"host\"`": dict(offload_optimizer=True, update_on="host"),
    "`update_on=\"host\"` + `offload_params`": dict(
        offload_optimizer=True, offload_params=True, update_on="host"),
    # ZeRO-Offload's 16-bit gradients: they cross in reduce_dtype.
    "`update_on=\"host\"`, `reduce_dtype=\"bfloat16\"`": dict(
        offload_optimizer=True, update_on="host", reduce_dtype="bfloat16"),
}


def _measured_step_s(size: str, batch: int) -> float | None:
  """The zero_jax stage-3 step a real H100 measured at this size and batch
  (``experiments/results/gpu_bench_h100.json``), if recorded."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                      "gpu_bench_h100.json")
  if not os.path.exists(path):
    return None
  with open(path, encoding="utf-8") as f:
    calls = json.load(f)["calls"]
  for run in (r for c in calls for r in c.get("runs", [])):
    if (run.get("size") == size and run.get("batch") == batch and
        run.get("mode") == "zero_jax stage 3" and run.get("status") == "ok"):
      return run["step_s"]
  return None


def predict(to_device: int, to_host: int, step_s: float, host_s: float,
            links: tuple[float, float, float]) -> tuple[float, float, float]:
  """(link seconds, step seconds overlapped, step seconds in sequence).

  The link moves ``to_device`` at ``links[0]`` and ``to_host`` at
  ``links[1]`` bytes/s, both at once at ``links[2]``: at least the slowest
  of the three times. Overlapped: nothing is faster than its slowest part.
  In sequence: the host's update waits for the step and its gradients.
  """
  down, up, both = links
  link = max(to_device / down, to_host / up, (to_device + to_host) / both)
  return link, max(step_s, link, host_s), max(step_s, link) + host_s


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--size", choices=sorted(SIZES), default="1.3b")
  p.add_argument("--micro-batch", type=int, default=16)
  p.add_argument("--step-s", type=float, default=None,
                 help="the no-offload step on a real GPU (default: the "
                 "H100's, from experiments/results/gpu_bench_h100.json)")
  p.add_argument("--host-rate", type=float, default=0.78e9,
                 help="the host update's parameters per second (default: "
                 "XLA:CPU on the 16 cores of an H100 host)")
  p.add_argument("--link-gib-s", type=float, nargs=3, default=(32, 50, 52),
                 metavar=("TO_DEVICE", "TO_HOST", "BOTH"))
  p.add_argument("--out", default=None, help="also write the table here")
  args = p.parse_args()
  step_s = args.step_s or _measured_step_s(args.size, args.micro_batch)
  if step_s is None:
    p.error(f"no measured step for {args.size} at batch {args.micro_batch}: "
            "give --step-s")
  links = tuple(g * GIB for g in args.link_gib_s)
  shape = dict(SIZES[args.size], vocab=50304, seq_len=1024,
               micro_batch=args.micro_batch)
  rows = []
  for name, mode in MODES.items():
    _, c = compile_gpt("h100", 1, 3, **shape, **mode)
    psi = c.params
    host_s = psi / args.host_rate if mode.get("update_on") == "host" else 0.0
    link, overlapped, serial = predict(c.transfers.to_device,
                                       c.transfers.to_host, step_s, host_s,
                                       links)
    rows.append(
        f"| {name} | {c.transfers.to_device / GIB:.2f} | "
        f"{c.transfers.to_host / GIB:.2f} | "
        f"{c.transfer_bytes_per_param():.2f} | {link:.3f} | {host_s:.3f} | "
        f"{overlapped / step_s:.2f}x | {serial / step_s:.2f}x |")
    print(rows[-1], flush=True)
  text = "\n".join([
      f"# PCIe bytes per step of each offload mode: GPT {args.size}, one "
      f"H100, batch {args.micro_batch} x 1024",
      "",
      "`PYTHONPATH=. python experiments/offload_traffic.py`",
      "",
      f"Compiled for a compile-only H100 (stage 3, bf16 compute, fp32 "
      f"AdamW, remat full); Ψ = {psi:,}. Bytes: host <-> device per step "
      f"(`CompiledStep.transfers`). Link: "
      f"{' / '.join(f'{g:g}' for g in args.link_gib_s)} GiB/s to the "
      f"device / to the host / both at once. No-offload step "
      f"{step_s:.3f} s (a real H100), host update at "
      f"{args.host_rate / 1e9:.2f} G params/s. Predicted step, a lower "
      "bound: overlapped = the slowest of step, link and host update "
      "(`delay_update`); in sequence = step and link, then the host "
      "update.",
      "",
      "| mode | to device GiB | to host GiB | bytes / param | link s | "
      "host update s | overlapped / no offload | in sequence / no offload |",
      "|---|---|---|---|---|---|---|---|",
      *rows, ""])
  emit(text, args.out)


if __name__ == "__main__":
  main()
