"""Do the test suite's XLA flags change what the tests measure?

``tests/conftest.py`` turns XLA's LLVM backend optimizations down to make
compiling (most of the suite's time) faster. The tests check the compiled
step's memory and collectives, so this compiles a GPT step at every stage
with and without those flags (one process each: XLA reads its flags once)
and prints both, with whether they are identical::

  PYTHONPATH=. python experiments/compile_flags.py
"""

import json
import os
import subprocess
import sys

FAST = ("--xla_backend_optimization_level=0 "
        "--xla_llvm_disable_expensive_passes=true")
DEVICES = "--xla_force_host_platform_device_count=8"
COLUMNS = ("argument", "output", "temp", "alias", "all-gather",
           "reduce-scatter", "all-reduce")


def gpt_setup(d_model: int = 64, n_layers: int = 4, seq_len: int = 16,
              batch: int = 16):
  """The tests' tiny reference GPT (Flax NNX, scanned layers), one batch."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from zero_jax.models import GPT, GPTConfig, make_loss_fn  # pylint: disable=g-import-not-at-top

  cfg = GPTConfig(vocab_size=64, seq_len=seq_len, d_model=d_model,
                  n_layers=n_layers, n_heads=4)
  graphdef, params = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 64, size=(batch, seq_len + 1), dtype=np.int32)
  return make_loss_fn(graphdef), params, {"tokens": tokens}


def measure() -> list[list[int]]:
  """Per stage: the compiled step's bytes and collective counts."""
  import optax  # pylint: disable=g-import-not-at-top

  import zero_jax as zj  # pylint: disable=g-import-not-at-top

  loss_fn, params, batch = gpt_setup()
  rows = []
  for stage in range(4):
    engine = zj.Engine(loss_fn, optax.adamw(1e-3),
                       zj.ZeroConfig(stage=stage, min_shard_elements=0),
                       zj.make_mesh())
    compiled = engine.step.lower(engine.init(params), batch).compile()
    ma = compiled.memory_analysis()
    text = compiled.as_text()
    rows.append([ma.argument_size_in_bytes, ma.output_size_in_bytes,
                 ma.temp_size_in_bytes, ma.alias_size_in_bytes,
                 text.count("all-gather("), text.count("reduce-scatter("),
                 text.count("all-reduce(")])
  return rows


def main() -> None:
  if len(sys.argv) > 1 and sys.argv[1] == "--worker":
    print(json.dumps(measure()))
    return
  results = {}
  for name, flags in (("default", DEVICES), ("suite", f"{DEVICES} {FAST}")):
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, __file__, "--worker"], env=env,
                         capture_output=True, text=True, check=True).stdout
    results[name] = json.loads(out.strip().splitlines()[-1])
  print(f"{'stage':>5} {'flags':>8} " + " ".join(f"{c:>14}" for c in COLUMNS))
  for stage in range(4):
    for name, rows in results.items():
      print(f"{stage:>5} {name:>8} " +
            " ".join(f"{v:>14,}" for v in rows[stage]))
  same = results["default"] == results["suite"]
  print(f"\nidentical with and without the suite's flags: {same}")


if __name__ == "__main__":
  main()
