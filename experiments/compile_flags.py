"""Do the test suite's XLA flags change what the tests measure?

``tests/conftest.py`` sets XLA flags that make compiling (most of the
suite's time) faster:

- XLA's LLVM backend optimizations turned down, for CPU programs and GPU
  ones;
- ``--xla_gpu_autotune_level=0`` for programs compiled for GPUs without
  one: XLA then gives each kernel its default launch configuration instead
  of searching for one it cannot time (a third of a compile on jax 0.12).

The tests check the compiled step's memory, collectives and schedule, so
this compiles steps with and without those flags (one process each: XLA
reads its flags once) and prints both, with whether they are identical: a
GPT step at every stage on the 8 CPU devices, and, where JAX's CUDA plugin
is installed, steps compiled for H100s (every stage, hpZ, tensor
parallelism, ZeRO++'s quantized collectives, optimizer offload and cuDNN
attention). For those, the HLO text is compared too, less the kernels'
``backend_config`` (launch configurations) and the module's fingerprint::

  PYTHONPATH=. python experiments/compile_flags.py
"""

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys

CPU_FAST = ("--xla_backend_optimization_level=0 "
            "--xla_llvm_disable_expensive_passes=true")
GPU_FAST = f"{CPU_FAST} --xla_gpu_autotune_level=0"
DEVICES = "--xla_force_host_platform_device_count=8"
COLUMNS = ("argument", "output", "temp", "alias", "all-gather",
           "reduce-scatter", "all-reduce")
# The tiny GPT of tests/analysis/test_gpu_compiled.py.
_TINY = dict(layers=4, hidden=128, heads=4, vocab=64, seq_len=16,
             micro_batch=2)
# (name, compile_gpt's arguments) of the steps compiled for H100s.
GPU_STEPS = (
    *((f"stage {s}, 8 x h100", dict(devices=8, stage=s)) for s in range(4)),
    ("hpZ (2 replica groups)", dict(devices=8, stage=3, replica=2)),
    ("data 4 x model 2", dict(devices=8, stage=3, model=2,
                              attention="auto")),
    ("qwZ + qgZ", dict(devices=8, stage=3, overrides={
        "quantized_weights": True, "quantized_gradients": True,
        "loss_scope": "per_device"})),
    ("offload_optimizer, 1 x h100", dict(devices=1, stage=3,
                                         offload_optimizer=True)),
    ("cuDNN attention, 1 x h100", dict(devices=1, stage=3, seq_len=256,
                                       attention="auto")),
)


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


def measure_cpu() -> list[list[int]]:
  """Per stage: the CPU-compiled step's bytes and collective counts."""
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


def schedule_digest(hlo: str) -> str:
  """A digest of the HLO text less kernel launch configurations
  (``backend_config`` of fusions and custom calls; a while loop's, its
  trip count, is kept) and the module's fingerprint."""
  lines = []
  for line in hlo.splitlines():
    if " while(" not in line:
      line = re.sub(r", backend_config=\{.*$", "", line)
    lines.append(re.sub(r'fingerprint_before_lhs="[0-9a-f]*"', "", line))
  return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


def measure_gpu() -> list[list]:
  """Per GPU_STEPS row: memory, collectives and schedule digest."""
  from zero_jax import models  # pylint: disable=g-import-not-at-top

  rows = []
  for _, kwargs in GPU_STEPS:
    _, c = models.compile_gpt("h100", **{**_TINY, **kwargs})
    m = c.memory
    rows.append([[m.argument, m.output, m.temp, m.alias, m.host],
                 sorted([list(k), v] for k, v in c.collectives.items()),
                 schedule_digest(c.hlo)])
  return rows


def _worker(kind: str, flags: str):
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  out = subprocess.run([sys.executable, __file__, "--worker", kind],
                       env=env, capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  if len(sys.argv) > 2 and sys.argv[1] == "--worker":
    print(json.dumps(measure_cpu() if sys.argv[2] == "cpu" else
                     measure_gpu()))
    return
  cpu = {name: _worker("cpu", flags) for name, flags in (
      ("default", DEVICES), ("suite", f"{DEVICES} {CPU_FAST}"))}
  print("compiled for the 8 CPU devices:")
  print(f"{'stage':>5} {'flags':>8} " + " ".join(f"{c:>14}" for c in COLUMNS))
  for stage in range(4):
    for name, rows in cpu.items():
      print(f"{stage:>5} {name:>8} " +
            " ".join(f"{v:>14,}" for v in rows[stage]))
  same = cpu["default"] == cpu["suite"]
  print(f"identical with and without the suite's flags: {same}")
  if importlib.util.find_spec("jax_cuda12_plugin") is None:
    print("\n(JAX's CUDA plugin is not installed: steps compiled for GPUs "
          "not checked)")
    return
  gpu = {name: _worker("gpu", flags) for name, flags in (
      ("default", DEVICES), ("suite", f"{DEVICES} {GPU_FAST}"))}
  print("\ncompiled for H100s (bytes: argument, output, temp, alias, host; "
        "then whether collectives and schedule match):")
  all_same = True
  for i, (name, _) in enumerate(GPU_STEPS):
    d, s = gpu["default"][i], gpu["suite"][i]
    all_same &= d == s
    print(f"  {name:30s} default {d[0]}\n  {'':30s} suite   {s[0]}"
          f"  collectives {'same' if d[1] == s[1] else 'DIFFER'}, schedule "
          f"{'same' if d[2] == s[2] else 'DIFFERS'}")
  print(f"identical with and without the suite's flags: {all_same}")


if __name__ == "__main__":
  main()
