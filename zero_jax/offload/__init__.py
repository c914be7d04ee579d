"""Offload: updating state that lives outside device memory.

``Streamer`` streams offloaded master and optimizer state through the
device a slice at a time (exact where ``separable`` proves the optimizer
keeps rows and leaves apart); ``HostUpdate`` runs the update as a program
of its own on the host's CPU devices (ZeRO-Offload's split), and
``MirroredUpdate`` does so in a multi-process run, each process updating
the shards its own devices hold. ``FusedUpdate`` runs the optimizers built
by ``adamw``, ``adam``, ``lion``, ``sgd`` and ``adagrad`` (optax's own,
remembered with their rule: ``rule_of``, a ``HostRule``) as one fused
multi-threaded pass over host buffers that zero_jax owns, the 16-bit
compute copy written in the same pass, by numba kernels (``kernels``, which
read arrays as ``as_kernel_array`` gives them); ``MirroredFused`` does so in
a multi-process run, each process on the shards its own devices hold.
``NvmeUpdate`` (ZeRO-Infinity's NVMe tier) keeps master and optimizer state
in files, updated a slice at a time, crash-consistent. A checkpoint reads
the host's state through ``in_place``, ``hold`` and ``settle``.
"""

from zero_jax.offload._disk import DiskError
from zero_jax.offload._fused import FusedUpdate
from zero_jax.offload._host import HostUpdate, MirroredUpdate
from zero_jax.offload._kernels import NOTHING, as_kernel_array, kernels
from zero_jax.offload._nvme import NvmeUpdate
from zero_jax.offload._optimizers import (HostRule, adagrad, adam, adamw,
                                          lion, rule_of, sgd)
from zero_jax.offload._registry import hold, in_place, settle
from zero_jax.offload._shards import MirroredFused
from zero_jax.offload._stream import Streamer

__all__ = [
    "DiskError",
    "FusedUpdate",
    "HostRule",
    "HostUpdate",
    "MirroredFused",
    "MirroredUpdate",
    "NOTHING",
    "NvmeUpdate",
    "Streamer",
    "adagrad",
    "adam",
    "adamw",
    "as_kernel_array",
    "hold",
    "in_place",
    "kernels",
    "lion",
    "rule_of",
    "settle",
    "sgd",
]
