"""fsdp_fp8: load ModelOpt static-FP8 checkpoints into FSDP2-sharded PyTorch models.

Importing the package imports nothing else: each public name is loaded from its layer on
first use (PEP 562), so ``import fsdp_fp8.format`` does not pull in torchao or FSDP.
The layers and their rules are in docs/design.md.
"""

import re
import sys
from importlib import import_module, metadata

__version__ = "0.1.0"

# The oldest torch every module, test and bench here runs on (README: what was run, what read).
MIN_TORCH = (2, 10)


def _torch_version() -> str:
    """The torch this process has (or will import), read without importing it where possible."""
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:  # a source tree on sys.path: ask torch itself
        import torch

        return torch.__version__


def _check_torch() -> None:
    try:
        version = _torch_version()
    except ImportError:
        raise ImportError("fsdp_fp8 needs torch >= 2.10; this Python has no torch") from None
    match = re.match(r"(\d+)\.(\d+)", str(version))
    if match is None or (int(match[1]), int(match[2])) < MIN_TORCH:
        raise ImportError(
            f"fsdp_fp8 needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (FSDP2, DTensor and the FP8 "
            f"kernels it relies on); this Python ({sys.executable}) has torch {version}"
        )


_check_torch()

# public name -> the module that defines it
_PUBLIC = {
    "ModelSpec": "fsdp_fp8.load.spec",
    "resolve_model_spec": "fsdp_fp8.interop.architectures",
    "LoadOptions": "fsdp_fp8.load.options",
    "KernelOptions": "fsdp_fp8.fp8.kernels",
    "Checkpoint": "fsdp_fp8.format.checkpoint",
    "open_checkpoint": "fsdp_fp8.format.checkpoint",
    "ArgumentError": "fsdp_fp8.errors",
    "ArgumentTypeError": "fsdp_fp8.errors",
    "CheckpointError": "fsdp_fp8.errors",
    "LayoutError": "fsdp_fp8.errors",
    "ExportError": "fsdp_fp8.errors",
    "LoadFailedError": "fsdp_fp8.errors",
    "ModelUnusableError": "fsdp_fp8.errors",
    "PeerLostError": "fsdp_fp8.errors",
    "ProblemsError": "fsdp_fp8.errors",
    "QuantizeError": "fsdp_fp8.errors",
    "StepPolicy": "fsdp_fp8.format.step_policy",
    "parse_step_policy": "fsdp_fp8.format.step_policy",
    "resolve_step_policy": "fsdp_fp8.format.step_policy",
    "Float8StaticLinear": "fsdp_fp8.fp8.linear",
    "fuse_fp8_projections": "fsdp_fp8.fp8.topology",
    "share_quantized_inputs": "fsdp_fp8.fp8.shared_inputs",
    "LoadPlan": "fsdp_fp8.load.plan",
    "plan_load": "fsdp_fp8.load.plan",
    "swap_fp8_linears": "fsdp_fp8.load.swap",
    "shard_model": "fsdp_fp8.load.fsdp_wrap",
    "build_mesh": "fsdp_fp8.runtime.parallel_mesh",
    "ParallelLayout": "fsdp_fp8.runtime.parallel_layout",
    "ParallelMesh": "fsdp_fp8.runtime.parallel_mesh",
    "materialize": "fsdp_fp8.load.meta_build",
    "meta_init": "fsdp_fp8.load.meta_build",
    "LoadReport": "fsdp_fp8.load.reader",
    "ReadOptions": "fsdp_fp8.reading.read_options",
    "collective_phase": "fsdp_fp8.collective.phase",
    "load_checkpoint": "fsdp_fp8.load.reader",
    "gather_state_dict": "fsdp_fp8.save.gather",
    "SavePlan": "fsdp_fp8.save.plan",
    "plan_save": "fsdp_fp8.save.plan",
    "SaveReport": "fsdp_fp8.save.save_checkpoint",
    "save_checkpoint": "fsdp_fp8.save.save_checkpoint",
    "LoadedModel": "fsdp_fp8.load.loaded",
    "load_model": "fsdp_fp8.compose.model",
    "export_bf16": "fsdp_fp8.export.modelopt",
    "export_fp8": "fsdp_fp8.export.modelopt",
    "denoising_step": "fsdp_fp8.runtime.precision",
    "install_step_policy": "fsdp_fp8.runtime.precision",
    "routing_of": "fsdp_fp8.runtime.precision",
    "quantize_model": "fsdp_fp8.runtime.ptq",
    "prepare_for_inference": "fsdp_fp8.runtime.inference",
    "load_pipeline": "fsdp_fp8.compose.pipeline",
    "Engine": "fsdp_fp8.generation.engine",
    "Observer": "fsdp_fp8.generation.engine",
    "Task": "fsdp_fp8.generation.engine",
    "tasks_of": "fsdp_fp8.generation.engine",
    "generate": "fsdp_fp8.generation.engine",
    "GenerationRequest": "fsdp_fp8.generation.values",
    "Prompt": "fsdp_fp8.generation.values",
    "RunSettings": "fsdp_fp8.generation.values",
    "TaskResult": "fsdp_fp8.generation.results",
    "GenerationError": "fsdp_fp8.errors",
    "loaded_of": "fsdp_fp8.compose.pipeline",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'fsdp_fp8' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
