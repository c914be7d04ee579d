"""Offload: updating state that lives outside device memory.

``Streamer`` streams offloaded master and optimizer state through the
device a slice at a time (exact where ``separable`` proves the optimizer
keeps rows and leaves apart); ``HostUpdate`` runs the update as a program
of its own on the host's CPU devices (ZeRO-Offload's split), and
``MirroredUpdate`` does so in a multi-process run, each process updating
the shards its own devices hold. ``FusedUpdate`` runs the optimizers built
by ``adamw``, ``adam``, ``lion``, ``sgd`` and ``adagrad`` (optax's own,
remembered with their rule) as one fused multi-threaded pass over host
buffers that zero_jax owns, the 16-bit compute copy written in the same
pass; ``MirroredFused`` does so in a multi-process run, each process on
the shards its own devices hold. ``NvmeUpdate`` (ZeRO-Infinity's NVMe
tier) keeps master and optimizer state in files, updated a slice at a
time, crash-consistent.
"""

from zero_jax.offload._disk import DiskError
from zero_jax.offload._fused import FusedUpdate
from zero_jax.offload._host import HostUpdate, MirroredUpdate, host_devices
from zero_jax.offload._kernels import NOTHING, as_kernel_array, kernels
from zero_jax.offload._nvme import NvmeUpdate
from zero_jax.offload._optimizers import (HostRule, Kind, adagrad, adam,
                                          adamw, lion, rule_of, sgd)
from zero_jax.offload._registry import hold, in_place, settle
from zero_jax.offload._separable import Report, Tag, analyze
from zero_jax.offload._shards import MirroredFused
from zero_jax.offload._stream import SLICE_BYTES, Streamer

__all__ = [
    "DiskError",
    "FusedUpdate",
    "HostRule",
    "HostUpdate",
    "Kind",
    "MirroredFused",
    "MirroredUpdate",
    "NOTHING",
    "NvmeUpdate",
    "Report",
    "SLICE_BYTES",
    "Streamer",
    "Tag",
    "adagrad",
    "adam",
    "adamw",
    "analyze",
    "as_kernel_array",
    "hold",
    "host_devices",
    "in_place",
    "kernels",
    "lion",
    "rule_of",
    "settle",
    "sgd",
]
