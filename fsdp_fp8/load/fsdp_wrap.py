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
    """The repeated blocks to shard one by one, outermost only.

    Hugging Face models name their block classes in ``_no_split_modules``; otherwise every
    member of an ``nn.ModuleList`` that holds parameters is a block. A block inside another
    block (an expert list inside a layer) stays part of its outer block: FSDP2 cannot wrap a
    module whose child was wrapped after it.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():  # parents before children
        if id(module) in inside:
            continue
        members = [module] if type(module).__name__ in names else []
        if not names and isinstance(module, nn.ModuleList):
            members = [m for m in module if any(True for _ in m.parameters())]
        for block in members:
            found.append(block)
            inside.update(id(m) for m in block.modules())
    return found


def fp32_units(model: nn.Module, inside: list[nn.Module]) -> list[nn.Module]:
    """Modules the class keeps in float32 (``_keep_in_fp32_modules``, e.g. Cosmos 3's
    ``time_embedder``) outside the blocks, outermost only.

    FSDP2 all-gathers a unit's parameters as one flat buffer and refuses a unit whose
    parameters have different dtypes, so a float32 module in a bfloat16 model is a unit of
    its own rather than part of the root's.
    """
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    skip = {id(m) for block in inside for m in block.modules()}
    found: list[nn.Module] = []
    for name, module in model.named_modules():
        if id(module) in skip or not name or name.split(".")[-1] not in keep:
            continue
        if any(True for _ in module.parameters()):
            found.append(module)
            skip.update(id(m) for m in module.modules())
    return found


def shard_model(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``fully_shard`` each block (resharding after forward), then the root (which does not).

    The blocks are wrapped with ``reshard_after_forward=False`` and then set to ``True``: the
    same behaviour as passing ``True``, without the metadata ``fully_shard`` computes at wrap
    time for resharding to a smaller group (``reshard_after_forward=<int>``, unused here), which
    costs a second ``torch.chunk`` of every parameter (bench/setup_cost.py).
    """
    units = blocks(model)
    for block in units + fp32_units(model, units):
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
        block.set_reshard_after_forward(True, recurse=False)
    fully_shard(model, mesh=mesh)
    return model
