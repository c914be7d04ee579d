"""Which mesh axis each collective of a tensor-parallel ZeRO-3 step runs on.

Compiles (never runs) the reference GPT's stage-3 step for 8 compile-only
H100s as (data 4, model 2) (``zero_jax.analysis``, no GPU needed; 4 layers
of width 128, bf16 compute) and prints one line per kind of collective and
mesh axes: its dtypes, result shapes and the replica groups of its first
instance in the HLO. ZeRO's gathers and reduce-scatters run along ``data``,
the compiler's tensor-parallel collectives along ``model``::

  PYTHONPATH=. python experiments/tp_collectives.py
"""

from __future__ import annotations

import re

from zero_jax import analysis, models


def main() -> None:
  engine, c = models.compile_gpt(
      "h100", 8, 3, model=2, attention="auto", layers=4, hidden=128,
      heads=4, vocab=64, seq_len=16, micro_batch=2)
  mesh = engine.mesh
  print(f"mesh {dict(mesh.shape)}, device ids {mesh.device_ids.tolist()}")
  seen = set()
  for line in c.hlo.splitlines():
    ops = analysis.collectives(line) if "replica_groups=" in line else []
    if not ops:
      continue
    op = ops[0]
    key = (op.kind, op.axes(mesh))
    if key in seen:
      continue
    seen.add(key)
    groups = re.search(r"replica_groups=(\S+?),?\s", line).group(1)
    print(f"{op.kind:<15} along {op.axes(mesh)}: {'/'.join(op.dtypes)} "
          f"{list(op.shapes)} replica_groups={groups}")


if __name__ == "__main__":
  main()
