"""8 simulated CPU devices for every test; set before jax is imported."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS",
                                                                 ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " +
                             _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after the flags)

assert len(jax.devices()) >= 8, (
    "tests need 8 devices; XLA_FLAGS was set too late: " +
    os.environ["XLA_FLAGS"])
