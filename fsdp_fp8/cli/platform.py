"""What a digest in the launcher's report depends on besides the checkpoint and the options.

The same checkpoint, seed and options give the same digest at every world size on one
machine: sharding moves bytes, not arithmetic. Another torch build, another CPU (its vector
units pick other kernels) or another GPU model may round differently, so the report names
them next to the digest, and a digest compares only with one made on the same three.
"""

from __future__ import annotations

import platform

import torch


def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model")):  # x86; some ARM kernels say "Model"
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def platform_info(device: torch.device) -> dict:
    """``{"torch": version, "device_name": GPU or CPU model}`` for ``device``."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
        name = f"{name} (compute capability {capability}, CUDA {torch.version.cuda})"
    else:
        name = cpu_model()
    return {"torch": torch.__version__, "device_name": name}
