"""Checkpoints with orbax that restore into any stage, mesh and offload,
and parameters exported for plain Flax code."""

from zero_jax.checkpoint._checkpointer import (CheckpointWriteError,
                                               Checkpointer)
from zero_jax.checkpoint._export import export_params, load_params

__all__ = [
    "CheckpointWriteError",
    "Checkpointer",
    "export_params",
    "load_params",
]
