"""Offload: updating state that lives outside device memory.

``Streamer`` streams offloaded master and optimizer state through the
device a slice at a time (exact where ``separable`` proves the optimizer
keeps rows and leaves apart); ``HostUpdate`` runs the update as a program
of its own on the host's CPU devices (ZeRO-Offload's split), and
``MirroredUpdate`` does so in a multi-process run, each process updating
the shards its own devices hold.
"""

from zero_jax.offload._host import HostUpdate, MirroredUpdate, host_devices
from zero_jax.offload._separable import Report, Tag, analyze
from zero_jax.offload._stream import SLICE_BYTES, Streamer

__all__ = [
    "HostUpdate",
    "MirroredUpdate",
    "Report",
    "SLICE_BYTES",
    "Streamer",
    "Tag",
    "analyze",
    "host_devices",
]
