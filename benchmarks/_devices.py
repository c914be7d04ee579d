"""Shared by the benchmarks: simulate CPU devices when there is no GPU."""

import os


def simulate_cpu_devices(n: int = 8) -> None:
  """Asks XLA for ``n`` host (CPU) devices unless XLA_FLAGS already sets it.

  Must run before jax is imported. The flag only affects the host backend,
  so on a GPU machine it is harmless.
  """
  if "ZERO_JAX_CPU_DEVICES" in os.environ:
    return  # started by zero_jax.launch, which sets the device count
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={n}").strip()
