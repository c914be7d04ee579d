"""Configuration: ``ZeroConfig`` and the DeepSpeed JSON reader.

``ZeroConfig`` is a frozen dataclass, checked field by field when it is
made; ``from_deepspeed`` translates a DeepSpeed config into one, refusing by
name every key it cannot honour. Nothing here touches devices.
"""

from zero_jax.config._config import STAGES, ZeroConfig
from zero_jax.config._deepspeed import (MAPPING, DeepSpeedKey,
                                        from_deepspeed,
                                        mapping_table_markdown)
from zero_jax.config._remat import (AUTO_CANDIDATES, NAMED_POLICIES,
                                    REMAT_POLICIES, RematPolicy, check_remat)

__all__ = [
    "AUTO_CANDIDATES",
    "DeepSpeedKey",
    "MAPPING",
    "NAMED_POLICIES",
    "REMAT_POLICIES",
    "RematPolicy",
    "STAGES",
    "ZeroConfig",
    "check_remat",
    "from_deepspeed",
    "mapping_table_markdown",
]
