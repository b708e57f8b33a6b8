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
from fsdp_fp8.architectures import Architecture, resolve_architecture
from fsdp_fp8.checkpoint import Checkpoint, open_checkpoint
from fsdp_fp8.errors import CheckpointError
from fsdp_fp8.export import export_bf16, export_fp8
from fsdp_fp8.fp8_linear import Float8StaticLinear
from fsdp_fp8.fsdp_ops import install_fsdp_support
from fsdp_fp8.fsdp_wrap import shard_model
from fsdp_fp8.gather import gather_state_dict
from fsdp_fp8.loader import LoadFailedError, LoadReport, ModelUnusableError, load_checkpoint
from fsdp_fp8.meta_build import materialize, meta_init
from fsdp_fp8.plan import LoadPlan
from fsdp_fp8.precision import denoising_step, install_step_policy
from fsdp_fp8.ptq import quantize_model
from fsdp_fp8.shared_inputs import share_quantized_inputs
from fsdp_fp8.step_policy import StepPolicy, parse_step_policy, resolve_step_policy
from fsdp_fp8.swap import swap_fp8_linears
from fsdp_fp8.topology import fuse_fp8_projections

install_fsdp_support()

__all__ = [
    "Architecture",
    "Checkpoint",
    "CheckpointError",
    "Float8StaticLinear",
    "LoadFailedError",
    "LoadPlan",
    "LoadReport",
    "LoadedModel",
    "ModelUnusableError",
    "StepPolicy",
    "denoising_step",
    "export_bf16",
    "export_fp8",
    "fuse_fp8_projections",
    "gather_state_dict",
    "install_fsdp_support",
    "install_step_policy",
    "load_checkpoint",
    "load_model",
    "materialize",
    "meta_init",
    "open_checkpoint",
    "parse_step_policy",
    "quantize_model",
    "resolve_architecture",
    "resolve_step_policy",
    "shard_model",
    "share_quantized_inputs",
    "swap_fp8_linears",
]
