"""8 simulated CPU devices for every test; set before jax is imported.

The models are tiny, so compiling dominates the suite: XLA's LLVM backend
optimizations are turned down (8.5 instead of 11.4 minutes on 2 cores).
They act after buffer assignment: the compiled GPT step's argument, output,
temp and alias bytes and its collectives are identical with and without
them, at every stage (``PYTHONPATH=. python experiments/compile_flags.py``).
"""

import os

_FLAGS = {"xla_force_host_platform_device_count": "8",
          "xla_backend_optimization_level": "0",
          "xla_llvm_disable_expensive_passes": "true"}
for _name, _value in _FLAGS.items():
  if _name not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --{_name}={_value}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after the flags)

assert len(jax.devices()) >= 8, (
    "tests need 8 devices; XLA_FLAGS was set too late: " +
    os.environ["XLA_FLAGS"])
