"""PyTorch's step time on the reference GPT: the peer of ``gpu_bench.py``.

The same GPT as ``zero_jax.models.GPT`` (the same shapes, parameter count
and initialisation; learned positions, pre-LN blocks, no QKV bias, tanh
GELU, untied head), trained the usual PyTorch way: fp32 master weights,
bf16 autocast, ``scaled_dot_product_attention`` (flash on the GPU), fused
AdamW (lr 1e-4, betas 0.9/0.95, weight decay 0.1), ``torch.compile``, and
with ``--checkpoint block`` each block under ``torch.utils.checkpoint``.
``--fsdp`` shards with FSDP2 (``fully_shard`` per block and the root, one
rank, bf16 parameters and fp32 gradient reduction, each block compiled).

One run per process; the first step (compilation) is not timed, the step
time is the median of the others. The result is one stdout line
``RESULT {json}`` with ``gpu_bench.py``'s keys, so both go into one table::

  PYTHONPATH=. python experiments/torch_bench.py --size 1.3b --checkpoint none
  PYTHONPATH=. python experiments/torch_bench.py --size 1.3b --checkpoint block
  PYTHONPATH=. python experiments/torch_bench.py --size 1.3b --fsdp
  PYTHONPATH=. python experiments/torch_bench.py --tiny --size tiny --batch 2 \\
      --seq-len 32 --steps 2 --checkpoint block                 # CPU check

Without torch it reports ``status: "skipped (torch not installed)"``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import traceback
import types

import gpu_bench  # SIZES and TINY_SIZES (its top level imports only stdlib)

try:
  import torch
  import torch.nn.functional as F
  from torch import nn
  from torch.utils.checkpoint import checkpoint
except ImportError:  # main() reports "skipped (torch not installed)"
  torch = None
  nn = types.SimpleNamespace(Module=object)


def param_count(vocab: int, seq_len: int, d: int, layers: int) -> int:
  """Parameters of zero_jax's GPT: per block QKV 3d², output d² + d, MLP
  8d² + 5d, two LayerNorms 4d; embeddings, final LayerNorm, head."""
  return 12 * layers * d * d + 10 * layers * d + 2 * vocab * d \
      + seq_len * d + 2 * d


class Block(nn.Module):
  """One pre-LN block: ``h + attn(ln(h))``, then ``+ mlp(ln(.))``."""

  def __init__(self, d: int, heads: int, remat: bool):
    super().__init__()
    self.heads, self.remat = heads, remat
    self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
    self.qkv = nn.Linear(d, 3 * d, bias=False)
    self.out = nn.Linear(d, d)
    self.mlp_in = nn.Linear(d, 4 * d)
    self.mlp_out = nn.Linear(4 * d, d)

  def _forward(self, h: torch.Tensor) -> torch.Tensor:
    b, t, d = h.shape
    q, k, v = (a.view(b, t, self.heads, d // self.heads).transpose(1, 2)
               for a in self.qkv(self.ln1(h)).chunk(3, dim=-1))
    x = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    h = h + self.out(x.transpose(1, 2).reshape(b, t, d))
    x = F.gelu(self.mlp_in(self.ln2(h)), approximate="tanh")
    return h + self.mlp_out(x)

  def forward(self, h: torch.Tensor) -> torch.Tensor:
    if self.remat:
      return checkpoint(self._forward, h, use_reentrant=False)
    return self._forward(h)


class GPT(nn.Module):
  """zero_jax's GPT; ``forward`` returns the mean next-token loss."""

  def __init__(self, vocab: int, seq_len: int, d: int, layers: int,
               heads: int, remat: bool):
    super().__init__()
    self.tok_emb = nn.Embedding(vocab, d)
    self.pos_emb = nn.Embedding(seq_len, d)
    self.blocks = nn.ModuleList(Block(d, heads, remat)
                                for _ in range(layers))
    self.ln_f = nn.LayerNorm(d, eps=1e-5)
    self.head = nn.Linear(d, vocab, bias=False)
    # zero_jax's init: normal(0.02), the two residual projections
    # 0.02/sqrt(2L), biases 0; LayerNorms keep scale 1, bias 0.
    for name, p in self.named_parameters():
      if ".ln" in name or name.startswith("ln_f."):
        continue
      if name.endswith("bias"):
        nn.init.zeros_(p)
      else:  # "out.weight": the attention's and the MLP's output
        out = name.endswith("out.weight")
        nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers) if out else 0.02)

  def forward(self, tokens: torch.Tensor) -> torch.Tensor:
    """Mean fp32 cross-entropy of ``tokens[:, 1:]`` given ``[:, :-1]``."""
    x, y = tokens[:, :-1], tokens[:, 1:]
    h = self.tok_emb(x) + self.pos_emb.weight[:x.shape[1]]
    for block in self.blocks:
      h = block(h)
    logits = self.head(self.ln_f(h)).float()
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _fsdp(model: GPT, device: torch.device) -> GPT:
  """FSDP2 on one rank: ``fully_shard`` each (compiled) block, then the
  root, with bf16 parameters and fp32 gradient reduction."""
  import torch.distributed as dist  # pylint: disable=g-import-not-at-top
  from torch.distributed.device_mesh import init_device_mesh  # pylint: disable=g-import-not-at-top
  from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # pylint: disable=g-import-not-at-top
  dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                          store=dist.HashStore(), rank=0, world_size=1)
  mesh = init_device_mesh(device.type, (1,))
  mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                            reduce_dtype=torch.float32)
  for i, block in enumerate(model.blocks):
    block = torch.compile(block)  # as torchtitan: compiled, then sharded
    fully_shard(block, mesh=mesh, mp_policy=mp)
    model.blocks[i] = block
  fully_shard(model, mesh=mesh, mp_policy=mp)
  return model


def run(args: argparse.Namespace, base: dict) -> dict:
  """Trains ``args.steps`` steps; returns ``base`` plus the measurements."""
  from zero_jax import metrics as zm  # pylint: disable=g-import-not-at-top
  d, layers, heads = (gpu_bench.TINY_SIZES if args.tiny
                      else gpu_bench.SIZES)[args.size]
  vocab = 256 if args.tiny else 50304
  cuda = torch.cuda.is_available()
  device = torch.device("cuda" if cuda else "cpu")
  torch.manual_seed(0)
  model = GPT(vocab, args.seq_len, d, layers, heads,
              args.checkpoint == "block").to(device)
  psi = sum(p.numel() for p in model.parameters())
  assert psi == param_count(vocab, args.seq_len, d, layers), psi
  model = _fsdp(model, device) if args.fsdp else torch.compile(model)
  # (After fully_shard, which replaces the parameters by sharded ones.)
  opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95),
                          weight_decay=0.1, fused=cuda)
  gen = torch.Generator().manual_seed(0)
  tokens = torch.randint(0, vocab, (args.batch, args.seq_len + 1),
                         generator=gen).to(device)
  sync = torch.cuda.synchronize if cuda else lambda: None

  times, losses = [], []
  for _ in range(args.steps):
    sync()
    t = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
      loss = model(tokens)
    loss.backward()
    opt.step()
    sync()
    losses.append(loss.item())
    times.append(time.perf_counter() - t)
  step_s = statistics.median(times[1:] if len(times) > 1 else times)
  tps = args.batch * args.seq_len / step_s
  name = torch.cuda.get_device_name() if cuda else "cpu"
  peak = zm.peak_flops(name) if cuda else None
  fpt = zm.transformer_flops_per_token(psi, layers, args.seq_len, d)
  return {
      **base, "status": "ok", "params": psi, "device": name,
      "platform": "gpu" if cuda else "cpu", "torch": torch.__version__,
      "compile_s": times[0], "step_s": step_s, "tokens_per_s": tps,
      "mfu": zm.mfu(fpt, tps, peak), "peak_flops": peak, "losses": losses,
      "peak_bytes_in_use": torch.cuda.max_memory_allocated() if cuda
                           else None,
      "bytes_limit": torch.cuda.get_device_properties(0).total_memory
                     if cuda else None,
      "compiled_device_bytes": None,
  }


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--size", default="1.3b",
                 choices=sorted(gpu_bench.SIZES) + sorted(gpu_bench.TINY_SIZES))
  p.add_argument("--tiny", action="store_true",
                 help="vocabulary 256 and the tiny sizes (CPU check)")
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq-len", type=int, default=1024)
  p.add_argument("--steps", type=int, default=6)
  p.add_argument("--checkpoint", default="block", choices=("none", "block"),
                 help="activation checkpointing: none, or each block")
  p.add_argument("--fsdp", action="store_true",
                 help="FSDP2 on one rank (fully_shard per block and root)")
  args = p.parse_args()
  remat = args.checkpoint == "block"
  if args.fsdp:
    mode = "torch FSDP2" + (", per-block checkpoint" if remat else "") \
        + ", compiled"
  else:
    mode = "torch.compile" + (", per-block checkpoint" if remat else "")
  base = {"size": args.size, "mode": mode, "batch": args.batch,
          "seq_len": args.seq_len, "steps": args.steps, "tiny": args.tiny,
          "remat": "per-block checkpoint" if remat else "none"}
  if torch is None:
    result = {**base, "status": "skipped (torch not installed)"}
  else:
    try:
      result = run(args, base)
    except Exception as e:  # pylint: disable=broad-except
      text = traceback.format_exc()
      oom = (isinstance(e, torch.cuda.OutOfMemoryError)
             or "out of memory" in text.lower())
      result = {**base, "status": "oom" if oom else "error",
                "error": text[-2000:]}
  print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
