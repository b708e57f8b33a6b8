"""fsdp_fp8: load ModelOpt static-FP8 checkpoints into FSDP2-sharded PyTorch models."""

import logging as _logging


class _ImportNoise(_logging.Filter):
    """TorchAO 0.18 warns on import that its optional CUDA kernels (mxfp8, cutlass) do not
    load on a CPU build, and torch warns about its Enum registration; fsdp_fp8 uses neither,
    so every rank printing them only hides real messages."""

    def filter(self, record: _logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith("Failed to load") and "torchao/_C" in msg) and (
            "is an Enum subclass and is now natively supported" not in msg
        )


for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).addFilter(_ImportNoise())

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
