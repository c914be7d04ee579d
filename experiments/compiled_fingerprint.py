"""The compiled train step's bytes and collectives, one JSON line per config.

A refactor that means to change no program runs this at the commit before
and after it and diffs the output: the reference GPT (4 layers, d_model
256), compiled for 8 H100s (``zero_jax.analysis``; no GPU needed), at
stages 0-3, bfloat16, both offloads and the host update. Each line holds
the device's argument, output, temp and alias bytes, the host bytes, and
every (collective, dtype) with its count and bytes per step.

  JAX_PLATFORMS=cpu PYTHONPATH=. python experiments/compiled_fingerprint.py \\
      > after.jsonl
"""

import argparse
import json

from zero_jax.models import compile_gpt

CONFIGS = [dict(stage=s) for s in (0, 1, 2, 3)] + [
    dict(stage=1, compute_dtype="bfloat16"),
    dict(stage=3, compute_dtype="bfloat16"),
    dict(stage=3, compute_dtype="bfloat16", offload_optimizer=True),
    dict(stage=3, compute_dtype="bfloat16", offload_optimizer=True,
         offload_params=True),
    dict(stage=3, compute_dtype="bfloat16", offload_optimizer=True,
         update_on="host"),
    dict(stage=2, compute_dtype="bfloat16", offload_optimizer=True)]


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--devices", type=int, default=8)
  args = p.parse_args(argv)
  for config in CONFIGS:
    options = dict(config)
    stage = options.pop("stage")
    dtype = options.pop("compute_dtype", None)
    _, step = compile_gpt("h100", args.devices, stage, layers=4, hidden=256,
                          heads=4, vocab=1024, seq_len=128, micro_batch=2,
                          compute_dtype=dtype, **options)
    m = step.memory
    print(json.dumps({
        **config, "argument": m.argument, "output": m.output,
        "temp": m.temp, "alias": m.alias, "host": m.host,
        "collectives": sorted((f"{kind} {dt}", v["count"], v["bytes"])
                              for (kind, dt), v in step.collectives.items())
    }), flush=True)


if __name__ == "__main__":
  main()
