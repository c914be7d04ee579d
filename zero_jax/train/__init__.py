"""The train step: ``Engine``, its ``TrainState`` and the jitted step.

The engine lays out the state for the parameters it is given, builds the
first state, and runs one jitted, donating step: loss and gradients inside
``shard_map`` (reduced into the ZeRO layout), then the optimizer update on
the sharded arrays. ``initialize`` builds the engine and its first state
from a DeepSpeed config, as ``deepspeed.initialize`` does.

Later layers plug into the step through its hooks: step listeners
(``add_step_listener``; ``step_done`` runs them), the last checkpoint
(``set_last_checkpoint``) and the abort probe of the processes' batch check
(``set_abort_probe``).
"""

from zero_jax.train._engine import Engine
from zero_jax.train._grads import Loss
from zero_jax.train._hooks import (add_step_listener, set_abort_probe,
                                   set_last_checkpoint, step_done)
from zero_jax.train._from_config import initialize
from zero_jax.train._step_plan import BatchLayout, StepPlan
from zero_jax.train._loss_scale import LossScaleState
from zero_jax.train._runner import StepFailedError, StepFunction
from zero_jax.train._state import TrainState
from zero_jax.train._train_step import jit_step, train_step
from zero_jax.train._update import OnDevice, UpdateStrategy
from zero_jax.train._offloaded import OnHost, Streamed

__all__ = [
    "BatchLayout",
    "Engine",
    "Loss",
    "LossScaleState",
    "OnDevice",
    "OnHost",
    "StepFailedError",
    "StepFunction",
    "StepPlan",
    "Streamed",
    "TrainState",
    "UpdateStrategy",
    "add_step_listener",
    "initialize",
    "jit_step",
    "set_abort_probe",
    "set_last_checkpoint",
    "step_done",
    "train_step",
]
