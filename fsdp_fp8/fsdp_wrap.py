"""Compose ``fully_shard``: each transformer block, then the root (torchtitan's pattern)."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard


def default_mesh(device_type: str) -> DeviceMesh:
    """A 1-D mesh over every rank of the default process group."""
    return init_device_mesh(device_type, (dist.get_world_size(),))


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one.

    Hugging Face models name their block classes in ``_no_split_modules``; otherwise every
    member of an ``nn.ModuleList`` that holds parameters is a block.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        return [m for m in model.modules() if type(m).__name__ in names]
    found = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            found.extend(m for m in module if any(True for _ in m.parameters()))
    return found


def shard_model(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    for block in blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
