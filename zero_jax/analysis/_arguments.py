"""The command line of ``python -m zero_jax.estimate``: its arguments and
how each is parsed (``_cli`` reports on them)."""

from __future__ import annotations

import argparse
import math
import re
from typing import Any

from zero_jax.analysis import _memory as memory
from zero_jax.config import REMAT_POLICIES

COMPUTE_DTYPES = {"fp32": None, "float32": None, "bf16": "bfloat16",
                   "bfloat16": "bfloat16", "fp16": "float16",
                   "float16": "float16"}
_SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
MAX_BYTES = 2.0 ** 64


def parse_count(text: str) -> float:
  """Parses a parameter count: ``7.5e9``, ``1.3B``, ``125M``, ``350k``.

  Args:
    text: a number, optionally with a k/M/B(G)/T suffix (any case) and
      ``_`` or ``,`` separators.

  Returns:
    The count.

  Raises:
    argparse.ArgumentTypeError: not such a count, not finite (``1e400``),
      or not positive.
  """
  m = re.fullmatch(r"\s*([0-9][0-9_,]*\.?[0-9]*(?:e[+-]?[0-9]+)?)\s*"
                   r"([kmbgt]?)\s*", text, re.IGNORECASE)
  if not m:
    raise argparse.ArgumentTypeError(
        f"invalid count {text!r}: use a number such as 7.5e9, 1.3B, 125M or "
        "350k")
  value = float(m.group(1).replace("_", "").replace(",", ""))
  value *= _SUFFIXES[m.group(2).lower()]
  if not math.isfinite(value):
    raise argparse.ArgumentTypeError(
        f"count {text!r} is beyond a float's range: use a number such as "
        "7.5e9 or 1.3B")
  if value <= 0:
    raise argparse.ArgumentTypeError(f"count must be > 0, got {text!r}")
  return value


def parsed(text: str, cast: type, expected: str) -> Any:
  """``cast(text)``, or the argparse error for a value that is not one."""
  try:
    return cast(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")


def bytes_per_param(text: str) -> float:
  """``--k``: finite bytes >= 0 (``float`` alone takes nan and inf)."""
  value = parsed(text, float, "a number")
  if not (math.isfinite(value) and value >= 0):
    raise argparse.ArgumentTypeError(
        f"must be a finite number >= 0 (optimizer-state bytes per "
        f"parameter, e.g. 8 for fp32 Adam), got {text!r}")
  return value


def positive_int(text: str) -> int:
  value = parsed(text, int, "an integer")
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
  return value


def build_parser() -> argparse.ArgumentParser:
  """The command line's argument parser."""
  p = argparse.ArgumentParser(
      prog="python -m zero_jax.estimate",
      description="Per-device memory and communication of ZeRO stages 0-3 "
      "under zero_jax, next to the ZeRO paper's formula.",
      epilog="example: python -m zero_jax.estimate --params 7.5e9 "
      "--devices 64 --stage 3")
  p.add_argument("--params", type=parse_count, default=None,
                 help="parameter count Ψ: 7.5e9, 1.3B, 125M, 350k "
                 "(required unless --compile, which counts the model's)")
  p.add_argument("--devices", type=positive_int, required=True,
                 help="devices in all")
  p.add_argument("--stage", choices=("0", "1", "2", "3", "all"),
                 default="all", help="ZeRO stage (default: all)")
  p.add_argument("--optimizer", default="adamw",
                 choices=sorted(memory.OPTIMIZER_STATE_BYTES),
                 help="sets the optimizer-state bytes per parameter K "
                 "(default adamw: 8)")
  p.add_argument("--k", type=bytes_per_param, default=None,
                 help="optimizer-state bytes per parameter; overrides "
                 "--optimizer")
  p.add_argument("--compute-dtype", default="fp32",
                 choices=sorted(COMPUTE_DTYPES),
                 help="dtype of the forward/backward (default fp32: fp32 "
                 "training)")
  p.add_argument("--reduce-dtype", default="fp32",
                 choices=sorted(COMPUTE_DTYPES),
                 help="dtype gradients are summed in across devices "
                 "(default fp32, as ZeroConfig)")
  p.add_argument("--replica", type=positive_int, default=1,
                 help="replica groups R: state is sharded over devices / R "
                 "and replicated over R (default 1)")
  p.add_argument("--model-parallel", type=positive_int, default=1,
                 metavar="M",
                 help="model-parallel degree M (tensor parallelism over "
                 "make_mesh(model=M)): each device holds Ψ/M parameters' "
                 "model states, sharded over devices / (R x M) (default 1)")
  p.add_argument("--offload-optimizer", action="store_true",
                 help="optimizer state (and the fp32 master where forward "
                 "reads a compute copy) in host memory")
  p.add_argument("--offload-params", action="store_true",
                 help="stage 3: the fp32 master shards in host memory")
  act = p.add_argument_group(
      "activations (optional; all of --layers --hidden --seq-len "
      "--micro-batch --heads)")
  act.add_argument("--layers", type=positive_int, help="transformer blocks")
  act.add_argument("--hidden", type=positive_int, help="model width")
  act.add_argument("--seq-len", type=positive_int, help="tokens/sequence")
  act.add_argument("--micro-batch", type=positive_int,
                   help="sequences per data-parallel rank per step (per "
                   "device without --model-parallel)")
  act.add_argument("--heads", type=positive_int, help="attention heads")
  act.add_argument("--vocab", type=positive_int, default=None,
                   help="vocabulary size (adds the logits)")
  act.add_argument("--remat", choices=tuple(REMAT_POLICIES), default="full",
                   help="per-layer rematerialization (default full; the "
                   "analytic activations know full and none)")
  comp = p.add_argument_group(
      "compile (optional): the reference GPT of the shape above, compiled "
      "for GPUs that need not be present")
  comp.add_argument("--compile", metavar="TARGET", default=None,
                    help="GPU to compile for: h100, h200 or a100-80gb "
                    "(needs: pip install \"zero-jax[gpu-compile]\")")
  comp.add_argument("--attention", default="fused",
                    choices=("fused", "einsum", "auto", "cudnn"),
                    help="GPTConfig.attention (default fused, which the "
                    "recorded figures used; auto: cuDNN's flash attention)")
  return p


