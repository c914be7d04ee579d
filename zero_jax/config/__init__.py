"""Configuration: ``ZeroConfig`` and the DeepSpeed JSON reader.

``ZeroConfig`` is a frozen dataclass of sections (``MixedPrecision``,
``LossScaling``, ``Offload``, ``ZeroPP``, ``Activations``, ``Batch``),
checked field by field when it is made, with DeepSpeed's flat keywords as
a shorthand (``SHORTHAND``); ``from_deepspeed`` translates a DeepSpeed
config into one, refusing by name every key it cannot honour, and
``read_deepspeed`` also returns its optimizer and scheduler sections (a
``DeepSpeedConfig``), which ``optimizer_from_deepspeed`` and
``schedule_from_deepspeed`` turn into an optax transformation and a
learning-rate schedule. Nothing here touches devices.
"""

from zero_jax.config._config import SHORTHAND, ZeroConfig, nest
from zero_jax.config._deepspeed import (DeepSpeedConfig, from_deepspeed,
                                        read_deepspeed)
from zero_jax.config._ds_mapping import (key_list_markdown,
                                         mapping_table_markdown)
from zero_jax.config._ds_optim import (optimizer_from_deepspeed,
                                       schedule_from_deepspeed)
from zero_jax.config._nvme import NvmeOptions
from zero_jax.config._offload import Offload
from zero_jax.config._remat import REMAT_POLICIES, Activations, RematPolicy
from zero_jax.config._sections import (Accumulation, Batch, LossScaling,
                                       LossScope, MixedPrecision, Tier,
                                       UpdateOn, ZeroPP)

__all__ = [
    "Accumulation",
    "Activations",
    "Batch",
    "DeepSpeedConfig",
    "LossScaling",
    "LossScope",
    "MixedPrecision",
    "NvmeOptions",
    "Offload",
    "REMAT_POLICIES",
    "RematPolicy",
    "SHORTHAND",
    "Tier",
    "UpdateOn",
    "ZeroConfig",
    "ZeroPP",
    "from_deepspeed",
    "key_list_markdown",
    "mapping_table_markdown",
    "nest",
    "optimizer_from_deepspeed",
    "read_deepspeed",
    "schedule_from_deepspeed",
]
