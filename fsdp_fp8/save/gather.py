"""Gather a sharded model's full state onto rank 0, one tensor at a time, in checkpoint form.

Every tensor travels as bytes (``uint8``): gloo refuses float8 ("Invalid scalar type"),
and one byte path serves every dtype and backend. Each rank pads its rows to
``ceil(rows / shards)`` so the gather has equal sizes; rank 0 trims and views back. Under
HSDP only rank 0's replica gathers (over its shard-dim group); the other replicas hold the
same rows and send nothing.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_fp8.collective import rank_and_world
from fsdp_fp8.fp8.tensor import E4M3, is_static_fp8
from fsdp_fp8.load.fsdp_wrap import primary_replica
from fsdp_fp8.save.plan import persistent_tensors, static_fp8_parts
from fsdp_fp8.shard_rows import padded_rows


def _rows_as_bytes(local: torch.Tensor, row_shape: tuple[int, ...]) -> torch.Tensor:
    row_bytes = math.prod(row_shape) * local.element_size()
    return local.contiguous().reshape(-1).view(torch.uint8).reshape(-1, row_bytes)


def _gather_rows(param: DTensor, local: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The full tensor on global rank 0 (CPU), None elsewhere. Only rank 0's shard group (its
    replica, under HSDP) takes part; the gather runs over that group, not the default one."""
    mesh = param.device_mesh
    line = primary_replica(mesh)
    if dist.get_rank() not in line:
        return None
    group = mesh.get_group(mesh.ndim - 1)
    world = len(line)
    rows, row_shape = param.shape[0], tuple(param.shape[1:])
    row_bytes = math.prod(row_shape) * torch.empty(0, dtype=dtype).element_size()
    padded = torch.zeros(padded_rows(rows, world), row_bytes, dtype=torch.uint8, device=local.device)
    if local.numel() > 0:
        mine = _rows_as_bytes(local, row_shape)
        padded[: mine.shape[0]].copy_(mine)
    is_dst = dist.get_rank() == 0
    buckets = [torch.empty_like(padded) for _ in range(world)] if is_dst else None
    dist.gather(padded, buckets, dst=0, group=group)
    if not is_dst:
        return None
    # The buckets come in group-rank order; the rows follow the mesh's shard coordinates.
    by_rank = dict(zip(dist.get_process_group_ranks(group), buckets))
    full = torch.cat([by_rank[r] for r in line])[:rows].cpu()
    return full.reshape(-1).view(dtype).reshape(param.shape)


def gather_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0 gets full CPU tensors under the model's names (FP8 as E4M3 + 0-d F32 scales).

    Collective: every rank must call it (under HSDP the ranks of other replicas return at once
    from each tensor). Memory stays bounded by one full tensor.
    """
    rank = rank_and_world()[0]
    out: dict[str, torch.Tensor] = {}
    for name, tensor in persistent_tensors(model):
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        if is_static_fp8(local):
            stem = name.removesuffix(".weight")
            codes, weight_scale, input_scale = static_fp8_parts(local)
            if isinstance(tensor, DTensor):
                full = _gather_rows(tensor, codes, E4M3)
            else:
                full = codes.detach().cpu().clone() if rank == 0 else None
            if rank == 0:
                out[name] = full
                out[f"{stem}.weight_scale"] = weight_scale.detach().cpu().clone()
                out[f"{stem}.input_scale"] = input_scale.detach().cpu().clone()
            continue
        if isinstance(tensor, DTensor):
            full = _gather_rows(tensor, local.detach(), local.dtype)
            if rank == 0:
                out[name] = full
        elif rank == 0:
            out[name] = tensor.detach().cpu().clone()
    return out
