"""fsdp_fp8: load ModelOpt static-FP8 checkpoints into FSDP2-sharded PyTorch models."""

from fsdp_fp8.api import LoadedModel, load_model
from fsdp_fp8.checkpoint import Checkpoint, open_checkpoint
from fsdp_fp8.errors import CheckpointError
from fsdp_fp8.fp8_linear import Float8StaticLinear
from fsdp_fp8.fsdp_ops import install_fsdp_support
from fsdp_fp8.gather import gather_state_dict
from fsdp_fp8.loader import LoadReport, ModelUnusableError, load_checkpoint
from fsdp_fp8.swap import swap_fp8_linears

install_fsdp_support()

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "Float8StaticLinear",
    "LoadReport",
    "LoadedModel",
    "ModelUnusableError",
    "gather_state_dict",
    "install_fsdp_support",
    "load_checkpoint",
    "load_model",
    "open_checkpoint",
    "swap_fp8_linears",
]
