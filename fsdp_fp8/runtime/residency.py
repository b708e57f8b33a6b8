"""Inference schedule for an FSDP2 model: which blocks stay unsharded between forwards, and
forward prefetch of the next block's all-gather.

:func:`apply_residency` sets ``reshard_after_forward`` per block (``--resident none|auto|all``).
Inference has no backward, so a block kept gathered is gathered once, in the first forward.
``auto`` keeps blocks in forward order while they and the in-flight reserve fit the budget. Every
rank takes the smallest budget of any rank (a collective): a rank that kept a block its peers
re-gather would hang them.

With ``prefetch`` each block issues the next block's all-gather before its own forward.

Design: docs/design.md, "Residency: blocks kept gathered between forwards".
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.fp8.tensor import is_static_fp8
from fsdp_fp8.load.fsdp_wrap import model_mesh, shard_size

log = logging.getLogger(__name__)

POLICIES = ("none", "auto", "all")
# Of the device's total memory, left for activations and allocator fragmentation under auto.
HEADROOM = 0.2


@dataclass(frozen=True)
class Residency:
    """What ``apply_residency`` chose, per rank (the ranks agree on ``resident``)."""

    policy: str
    blocks: int
    resident: tuple[int, ...]  # indices (forward order) of the blocks kept gathered
    budget_bytes: int | None  # the agreed budget (auto), None when not applicable
    resident_bytes: int  # what the resident blocks hold gathered, on every rank
    reserve_bytes: int  # in-flight room kept for the blocks that are still re-gathered
    gather_bytes_per_forward: int  # forecast: what this rank sends per steady-state forward
    first_forward_gather_bytes: int  # forecast: the first forward (every block and the root)
    prefetch: bool

    def as_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


def fsdp_blocks(model: nn.Module) -> list[FSDPModule]:
    """The FSDP-wrapped blocks below the root, in module (= forward) order."""
    return [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]


def _own_params(module: nn.Module, inner: list[nn.Module]) -> list[torch.Tensor]:
    """Parameters FSDP2 manages for ``module``: its own, not those of the FSDP blocks below it."""
    below = {id(p) for b in inner if b is not module for p in b.parameters()}
    return [p for p in module.parameters() if id(p) not in below]


def _gather_bytes(params, world: int) -> int:
    """Bytes one rank sends to unshard ``params``: ``ceil(rows / world)`` rows each (``world``:
    the shard-dim size), FP8 codes
    as one byte per element (the all-gather hooks send uint8; scales never travel)."""
    total = 0
    for p in params:
        local = p.to_local() if isinstance(p, DTensor) else p
        itemsize = 1 if is_static_fp8(local) else p.dtype.itemsize
        rows = p.shape[0] if p.ndim else 1
        total += math.ceil(rows / world) * math.prod(p.shape[1:]) * itemsize
    return total


def gather_bytes(model: nn.Module, world: int) -> tuple[int, list[int]]:
    """(root, per block): what this rank sends to unshard each FSDP unit once."""
    blocks = fsdp_blocks(model)
    root = _gather_bytes(_own_params(model, blocks), world) if isinstance(model, FSDPModule) else 0
    return root, [_gather_bytes(_own_params(b, blocks), world) for b in blocks]


def choose_resident(unsharded: list[int], budget: int, prefetch: bool) -> tuple[int, ...]:
    """Blocks in forward order while resident bytes + reserve fit ``budget``.

    The reserve is room for the blocks still re-gathered: the one running and, with
    prefetch, the next, each counted twice (FSDP2's flat all-gather buffer and the
    parameters copied out of it). It is 0 once every block is resident.
    """
    in_flight = 2 if prefetch else 1
    chosen: list[int] = []
    used = 0
    for i, size in enumerate(unsharded):
        rest = unsharded[i + 1 :]
        reserve = 2 * in_flight * max(rest) if rest else 0
        if used + size + reserve > budget:
            break
        chosen.append(i)
        used += size
    return tuple(chosen)


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = int(value.split()[0]) * 1024
    return out


def device_budget(device: torch.device) -> int | None:
    """Free memory the unsharded blocks may take on ``device``; None where nothing reports it."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    elif device.type == "cpu":
        try:
            info = _meminfo()
        except (OSError, ValueError, IndexError):
            return None
        free, total, cached = info["MemAvailable"], info["MemTotal"], 0
    else:
        return None
    return max(0, free + cached - int(HEADROOM * total))


def _agree_min(value: int, device: torch.device) -> int:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def apply_residency(
    model: nn.Module,
    policy: str,
    *,
    budget_bytes: int | None = None,
    prefetch: bool = True,
    device: torch.device | None = None,
) -> Residency:
    """Set ``reshard_after_forward`` per block and forward prefetch; collective under auto.

    Call it on every rank after ``load_model`` and before the first forward.
    """
    if policy not in POLICIES:
        raise ArgumentError(f"residency policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if budget_bytes is not None and budget_bytes < 0:
        raise ArgumentError(f"residency budget must be >= 0 bytes, got {budget_bytes}")
    # The all-gathers run over the shard dim (HSDP: within a replica), so what a rank sends
    # and what a block holds gathered follow the shard-dim size, not the world size.
    shards = shard_size(model_mesh(model))
    blocks = fsdp_blocks(model)
    root, per_block = gather_bytes(model, shards)
    unsharded = [shards * b for b in per_block]
    device = device or next(model.parameters()).device
    budget = None
    if policy == "all":
        resident = tuple(range(len(blocks)))
    elif policy == "none":
        resident = ()
    else:
        local = device_budget(device)
        if budget_bytes is not None:
            local = budget_bytes if local is None else min(local, budget_bytes)
        if local is None:
            raise ArgumentError(
                f"--resident auto needs a budget on {device} (nothing reports its free "
                "memory): state one with --resident-budget"
            )
        budget = _agree_min(local, device)
        resident = choose_resident(unsharded, budget, prefetch)
    keep = set(resident)
    for i, block in enumerate(blocks):
        block.set_reshard_after_forward(i not in keep, recurse=False)
    if prefetch and blocks:
        if isinstance(model, FSDPModule):
            model.set_modules_to_forward_prefetch([blocks[0]])
        for this, nxt in zip(blocks, blocks[1:]):
            this.set_modules_to_forward_prefetch([nxt])
    rest = [u for i, u in enumerate(unsharded) if i not in keep]
    return Residency(
        policy=policy,
        blocks=len(blocks),
        resident=resident,
        budget_bytes=budget,
        resident_bytes=sum(unsharded[i] for i in resident),
        reserve_bytes=2 * (2 if prefetch else 1) * max(rest) if rest else 0,
        gather_bytes_per_forward=sum(b for i, b in enumerate(per_block) if i not in keep),
        first_forward_gather_bytes=root + sum(per_block),
        prefetch=prefetch and bool(blocks),
    )
