"""Compose ``fully_shard``: each transformer block, then the root (torchtitan's pattern), over the
mesh's weight dims (``runtime.parallel_mesh`` builds the one mesh of a layout; ``default_mesh``:
every rank, when a ``load_model`` caller gives none).

A 1-D mesh is FSDP: every parameter is ``Shard(0)`` over all ranks. A 2-D mesh
``(replicate, shard)`` is HSDP: FSDP2 places each parameter as ``(Replicate(), Shard(0))``,
splits its rows over the *last* dim only (``torch.chunk`` over the shard-dim size) and
all-gathers within that dim's group; every replica holds the same rows in the same places.
So a rank's rows, reads, padding and all-gathers depend on its shard coordinate and the
shard-dim size, never on its global rank and the world size (``shard_position``).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from fsdp_fp8.collective import rank_and_world
from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.shard_rows import chunk_rows

HSDP_DIM_NAMES = ("replicate", "shard")
log = logging.getLogger(__name__)


def default_mesh(device_type: str) -> DeviceMesh:
    """A 1-D mesh over every rank of the default process group (``load_model`` without a mesh)."""
    return init_device_mesh(device_type, (dist.get_world_size(),))


def mesh_problems(mesh: DeviceMesh, device_type: str, world_size: int) -> list[str]:
    """What makes ``mesh`` unusable for ``load_model`` over ``world_size`` ranks on ``device_type``;
    decided from the mesh alone, so it touches no process group."""
    problems = []
    ranks = sorted(mesh.mesh.flatten().tolist())
    shape = "x".join(map(str, mesh.mesh.shape))
    if mesh.ndim not in (1, 2):
        problems.append(
            f"the mesh has {mesh.ndim} dimensions ({shape}); fsdp_fp8 shards over a 1-D mesh (FSDP) "
            "or a 2-D (replicate, shard) mesh (HSDP)"
        )
    if ranks != list(range(world_size)):
        problems.append(
            f"the mesh ({shape}, ranks {mesh.mesh.tolist()}) is not built over the default process "
            f"group's {world_size} ranks: every rank 0..{world_size - 1} must be in it exactly once"
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        problems.append(
            f"the 2-D mesh ({shape}) has no mesh_dim_names; FSDP2 finds the shard dim by name: build it "
            f"with init_device_mesh(..., mesh_dim_names={HSDP_DIM_NAMES!r})"
        )
    if mesh.device_type != device_type:
        problems.append(f"the mesh is on {mesh.device_type!r} but the model loads onto {device_type!r}")
    return problems


def model_facts(model: nn.Module, device_type: str, mesh: DeviceMesh | None) -> dict[str, dict[str, str]]:
    """The model's structure and where it goes: two ranks must build the very same thing."""
    structure = {f"module {name or '(root)'}": type(m).__name__ for name, m in model.named_modules()}
    structure.update({f"parameter {n}": f"{tuple(p.shape)} {p.dtype}" for n, p in model.named_parameters()})
    structure.update({f"buffer {n}": f"{tuple(b.shape)} {b.dtype}" for n, b in model.named_buffers()})
    placement = {"device type": device_type, "mesh": "every rank (1-D)", "placements": "(Shard(0),)"}
    if mesh is not None:  # HSDP: FSDP2 replicates over the first dim and shards over the last
        placement["mesh"] = f"{mesh.mesh.tolist()} dims {mesh.mesh_dim_names}"
        placement["placements"] = "(Replicate(), Shard(0))" if mesh.ndim == 2 else "(Shard(0),)"
    return {"model structure": structure, "placement": placement}


def shard_size(mesh: DeviceMesh | None) -> int:
    """Ranks one parameter's rows are split over: the mesh's last dim (every rank without a mesh)."""
    if mesh is None:
        return rank_and_world()[1]
    return mesh.size(mesh.ndim - 1)


def model_mesh(model: nn.Module) -> DeviceMesh | None:
    """The mesh ``model``'s parameters are sharded over (None: not sharded)."""
    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh
    return None


def primary_replica(mesh: DeviceMesh) -> list[int]:
    """The global ranks, in shard-coordinate order, of the shard-dim line through rank 0: one
    replica, whose ranks together hold every row once (under HSDP the others hold the same
    rows). ``gather_state_dict`` gathers and ``save_checkpoint`` writes rows from these only."""
    grid = mesh.mesh.reshape(-1, mesh.mesh.shape[-1])  # 1-D: one line; 2-D: one per replica
    lines = [row.tolist() for row in grid if 0 in row.tolist()]
    if len(lines) != 1:
        raise ArgumentError(f"rank 0 is not in the mesh {mesh.mesh.tolist()} exactly once")
    return lines[0]


def mesh_position(mesh: DeviceMesh | None) -> tuple[int, int]:
    """(shard-dim size, this rank's shard coordinate) on ``mesh``; (1, 0) without one.

    This, not (world size, rank), says which rows the rank holds and reads: under HSDP the
    ranks at one shard coordinate of different replicas hold the same rows.
    """
    if mesh is None:
        return 1, 0
    return mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)


def shard_position(model: nn.Module) -> tuple[int, int]:
    """(shard-dim size, this rank's shard coordinate) of a sharded model; (1, 0) if unsharded."""
    return mesh_position(model_mesh(model))


def local_rows(param: torch.Tensor, name: str = "tensor") -> tuple[torch.Tensor, int, int]:
    """This rank's storage of ``param`` and the global row range ``[start, stop)`` it holds
    (``(0, 0)`` for none): ``fsdp_fp8.shard_rows.chunk_rows`` of its shard coordinate.

    Over a 2-D HSDP mesh the placements are ``(Replicate(), Shard(0))``: the rows are the
    chunk of this rank's shard coordinate, the same on every replica.
    """
    if not isinstance(param, DTensor):
        return param, 0, (param.shape[0] if param.ndim else 1)
    *outer, inner = param.placements
    local = param._local_tensor
    if inner != Shard(0) or not all(p.is_replicate() for p in outer) or param.ndim == 0:
        raise NotImplementedError(
            f"`{name}` is sharded as {param.placements} (local shape {tuple(local.shape)} of "
            f"{tuple(param.shape)}); only dim-0 sharding (FSDP2's Shard(0)) is loaded"
        )
    start, stop = chunk_rows(param.shape[0], *mesh_position(param.device_mesh))
    return (local, start, stop) if stop > start else (local, 0, 0)


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


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    reshard_after_forward: bool | int = True,
) -> nn.Module:
    """``fully_shard`` each block, then the root, with the ``fully_shard`` options a user passes
    (torchtitan's ``apply_fsdp`` passes the same): ``mp_policy`` (FSDP2's
    ``MixedPrecisionPolicy``), ``offload_policy`` (``CPUOffloadPolicy``: sharded parameters live in
    host memory, all-gathered onto the device per unit) and ``reshard_after_forward`` for the blocks
    (the root keeps FSDP2's own default, which does not reshard it).

    With ``reshard_after_forward=True`` the blocks are wrapped with ``False`` and then set to
    ``True``: the same behaviour as passing ``True``, without the metadata ``fully_shard`` computes
    at wrap time for resharding to a smaller group (``reshard_after_forward=<int>``), which costs a
    second ``torch.chunk`` of every parameter (bench/setup_cost.py).
    """
    options = {}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    if offload_policy is not None:
        options["offload_policy"] = offload_policy
    units = blocks(model)
    for block in units + fp32_units(model, units):
        if reshard_after_forward is True:
            fully_shard(block, mesh=mesh, reshard_after_forward=False, **options)
            block.set_reshard_after_forward(True, recurse=False)
        else:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def shard_as(model: nn.Module, options) -> None:
    """``shard_model`` over ``options.mesh`` (default: every rank) with ``options``' FSDP settings
    (a ``LoadOptions``). Without a process group the model stays whole, and FSDP settings other
    than FSDP2's defaults are named as ignored."""
    fsdp_options = options.fsdp_options()
    if not (dist.is_available() and dist.is_initialized()):
        if fsdp_options:
            log.warning(
                "no process group: the model is not sharded and %s are ignored", ", ".join(sorted(fsdp_options))
            )
        return
    shard_model(model, options.mesh or default_mesh(options.device.type), **fsdp_options)


def planned_position(mesh: DeviceMesh | None) -> tuple[int, int]:
    """(shard-dim size, this rank's shard coordinate) a model will have once sharded over ``mesh``
    (``None``: every rank): what the prefetch hints and the outcome's wait are sized from."""
    if mesh is not None:
        return mesh_position(mesh)
    rank, world = rank_and_world()
    return world, rank
