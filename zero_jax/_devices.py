"""What the library knows of devices: which can only compile, how much
memory a step may use on one, and what a compiled step needs of it.

Compile-only devices (a GPU described by a spec, not present:
``zero_jax.analysis.gpu_devices``) report no memory and have no addressable
memories; their spec's memory is recorded here when they are made.
"""

from __future__ import annotations

import dataclasses
import os

import jax


def is_compile_only(device: jax.Device) -> bool:
  """True for devices that can compile but not run, e.g. those of
  ``jax.experimental.topologies`` (a GPU described, not present): they have
  no addressable memories."""
  try:
    return not device.addressable_memories()
  except Exception:  # pylint: disable=broad-except
    return True


# Compile-only devices with their memory (they report none), by id; each is
# kept alive, so its id is not reused.
_SPEC_MEMORY: dict[int, tuple[jax.Device, int]] = {}


def record_spec_memory(device: jax.Device, nbytes: int) -> None:
  """Records the memory of a compile-only device (its spec's
  ``device_memory_size``)."""
  _SPEC_MEMORY[id(device)] = (device, int(nbytes))


def device_memory(device: jax.Device) -> int | None:
  """Bytes a step may use on ``device``, or None if unknown: a GPU's
  allocator limit, a compile-only GPU's spec, a CPU device's share of the
  host's memory."""
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except
    stats = None
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  found = _SPEC_MEMORY.get(id(device))
  if found is not None and found[0] is device:
    return found[1]
  if device.platform == "cpu":
    try:
      total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
      return None
    return total // max(1, len(jax.local_devices(backend="cpu")))
  return None


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
  """Per-device bytes of a compiled step (from ``memory_analysis()``).

  Attributes:
    argument: bytes of all inputs (train state and batch).
    output: bytes of all outputs.
    temp: scratch bytes live during the step.
    alias: bytes of outputs that reuse donated inputs.
    host: bytes in host memory (``pinned_host``: offloaded arguments,
      outputs and scratch); not part of ``peak``. Only programs compiled
      for devices with host memory kinds (GPUs, TPUs) report any.
  """

  argument: int
  output: int
  temp: int
  alias: int
  host: int = 0

  @property
  def peak(self) -> int:
    """argument + output + temp - alias. (On CPU, ``peak_memory_in_bytes``
    leaves out temp, so it is recomputed here.)"""
    return self.argument + self.output + self.temp - self.alias


def compiled_memory(compiled) -> CompiledMemory:
  """Reads per-device byte counts off a compiled (``.compile()``) function."""
  ma = compiled.memory_analysis()
  host = lambda name: int(getattr(ma, f"host_{name}_size_in_bytes", 0) or 0)
  return CompiledMemory(argument=int(ma.argument_size_in_bytes),
                        output=int(ma.output_size_in_bytes),
                        temp=int(ma.temp_size_in_bytes),
                        alias=int(ma.alias_size_in_bytes),
                        host=(host("argument") + host("output") +
                              host("temp") - host("alias")))
