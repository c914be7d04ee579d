"""Configuration: ``ZeroConfig`` and the DeepSpeed JSON reader.

``ZeroConfig`` is a frozen dataclass of sections (``MixedPrecision``,
``LossScaling``, ``Offload``, ``ZeroPP``, ``Activations``, ``Batch``),
checked field by field when it is made, with DeepSpeed's flat keywords as
a shorthand (``SHORTHAND``); ``from_deepspeed`` translates a DeepSpeed
config into one, refusing by name every key it cannot honour, and
``read_deepspeed`` also returns its optimizer and scheduler sections, which ``optimizer_from_deepspeed`` turns
into an optax transformation. Nothing here touches devices.
"""

from zero_jax.config._config import SHORTHAND, STAGES, ZeroConfig, nest
from zero_jax.config._deepspeed import (DeepSpeedConfig, from_deepspeed,
                                        read_deepspeed)
from zero_jax.config._ds_auto import AUTO_KEYWORDS
from zero_jax.config._ds_mapping import (MAPPING, DeepSpeedKey,
                                         key_list_markdown,
                                         mapping_table_markdown)
from zero_jax.config._ds_optim import (OPTIMIZERS, SCHEDULERS,
                                       optimizer_from_deepspeed,
                                       schedule_from_deepspeed)
from zero_jax.config._ds_transforms import FusedForm, fused_form
from zero_jax.config._nvme import NvmeOptions
from zero_jax.config._offload import Offload
from zero_jax.config._remat import (AUTO_CANDIDATES, NAMED_POLICIES,
                                    REMAT_POLICIES, Activations, RematPolicy,
                                    check_remat)
from zero_jax.config._sections import (Accumulation, Batch, LossScaling,
                                       LossScope, MixedPrecision, Tier,
                                       UpdateOn, ZeroPP)

__all__ = [
    "Accumulation",
    "Activations",
    "Batch",
    "LossScaling",
    "LossScope",
    "MixedPrecision",
    "Offload",
    "SHORTHAND",
    "Tier",
    "UpdateOn",
    "ZeroPP",
    "AUTO_CANDIDATES",
    "AUTO_KEYWORDS",
    "DeepSpeedConfig",
    "DeepSpeedKey",
    "FusedForm",
    "MAPPING",
    "NAMED_POLICIES",
    "NvmeOptions",
    "OPTIMIZERS",
    "REMAT_POLICIES",
    "RematPolicy",
    "SCHEDULERS",
    "STAGES",
    "ZeroConfig",
    "check_remat",
    "from_deepspeed",
    "fused_form",
    "key_list_markdown",
    "mapping_table_markdown",
    "nest",
    "optimizer_from_deepspeed",
    "read_deepspeed",
    "schedule_from_deepspeed",
]
