"""Section ``versions``: python, torch, CUDA, NCCL, torchao and the other libraries' versions;
the device's name, capability, count and memory."""

from __future__ import annotations

import platform

from bench.gpu_smoke.context import Context


def section_versions(ctx: Context) -> None:
    import importlib

    import torch

    with ctx.variant("software") as r:
        r.update(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda)
        for mod in ("torchao", "safetensors", "numpy", "diffusers", "transformers", "triton"):
            try:
                r[mod] = importlib.import_module(mod).__version__
            except ImportError as exc:
                r[mod] = f"missing: {exc}"
    if ctx.device.type != "cuda" or ctx.fake:
        ctx.skip("device", "no real CUDA device: name, capability and NCCL not read")
        return
    with ctx.variant("device") as r:
        r.update(
            name=torch.cuda.get_device_name(ctx.device),
            capability=list(torch.cuda.get_device_capability(ctx.device)),
            count=torch.cuda.device_count(),
            memory_bytes=torch.cuda.get_device_properties(ctx.device).total_memory,
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
