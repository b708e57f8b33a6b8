"""Reference models: small, readable stand-ins with the published module names."""

from fsdp_fp8.models.mot import (
    ReasonerState,
    ReferenceMoTTransformer,
    build_model,
    init_weights,
    linear_towers,
)
from fsdp_fp8.models.mot_config import PRESETS, MoTConfig

__all__ = [
    "PRESETS",
    "MoTConfig",
    "ReasonerState",
    "ReferenceMoTTransformer",
    "build_model",
    "init_weights",
    "linear_towers",
]
