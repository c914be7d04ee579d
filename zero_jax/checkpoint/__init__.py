"""Checkpoints with orbax that restore into any stage, mesh and offload,
and parameters exported for plain Flax code."""

from zero_jax.checkpoint._checkpointer import Checkpointer
from zero_jax.checkpoint._errors import (CheckpointConflictError,
                                         CheckpointCorruptError,
                                         CheckpointWriteError)
from zero_jax.checkpoint._export import export_params, load_params
from zero_jax.checkpoint._integrity import checksums as array_checksums

__all__ = [
    "CheckpointConflictError",
    "CheckpointCorruptError",
    "CheckpointWriteError",
    "Checkpointer",
    "array_checksums",
    "export_params",
    "load_params",
]
