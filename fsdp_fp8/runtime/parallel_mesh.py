"""The one device mesh of a parallel layout: every rank, with its weight and work dims.

``build_mesh`` makes one world mesh over every rank and unflattens it twice (torchtitan's
``ParallelDims.build_mesh`` does the same for its data-loading and FSDP views), so every
feature takes its slice by name from one value: HSDP ``mesh.weights`` (``replicate``, ``shard``),
CFG pairs ``mesh["cfg"]``, Ulysses groups ``mesh["ulysses"]``, and the ranks of one request
together ``mesh.request_ranks`` (the split VAE decode). The rank order is the layout's
(``runtime.parallel_layout``: row-major, ``ulysses`` innermost; a replica is a run of neighbours).

Collective: every rank calls it with the same layout (each dim's process groups are made on
every rank), after the layout was validated, so a rank that could disagree failed before.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_fp8.runtime.parallel_layout import WEIGHT_DIMS, WORK_DIMS, ParallelLayout


@dataclass(frozen=True)
class ParallelMesh:
    """A layout's mesh: ``world`` (1-D, every rank, dim ``"world"``), its ``work`` view
    (``request``, ``cfg``, ``ulysses``) and the mesh the weights are sharded over (``weights``:
    the world itself, or the ``(replicate, shard)`` view under HSDP)."""

    layout: ParallelLayout
    world: DeviceMesh
    work: DeviceMesh
    weights: DeviceMesh
    # every rank of one request on one dim (its CFG pair and Ulysses group together, the writer
    # first): a view of its own only when both split a request; else the one dim that does
    teams: DeviceMesh | None = None

    @property
    def request_ranks(self) -> DeviceMesh | None:
        """The 1-D mesh of the ranks that share this rank's request, the writing rank at local rank
        0 (the split VAE decode's group); None when a request has one rank."""
        cfg, ulysses = self.layout.cfg, self.layout.ulysses
        if cfg > 1 and ulysses > 1:
            return self.teams["request_ranks"]
        if cfg > 1 or ulysses > 1:
            return self.work["cfg" if cfg > 1 else "ulysses"]
        return None

    def __getitem__(self, name: str) -> DeviceMesh:
        """The 1-D slice of dim ``name`` through this rank (``mesh["cfg"].get_group()``)."""
        if name in WORK_DIMS:
            return self.work[name]
        if name in WEIGHT_DIMS and self.layout.replicas > 1:
            return self.weights[name]
        if name == "shard":  # FSDP: one shard group, every rank
            return self.world
        if name == "replicate":
            raise KeyError(
                "no mesh dim 'replicate': the layout has no HSDP replicas (the weights are sharded over every rank)"
            )
        raise KeyError(f"no mesh dim {name!r}; the dims are {', '.join(WORK_DIMS + WEIGHT_DIMS)}")


def _unflatten(world: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """``world`` cut into ``sizes`` named ``names``, row-major: ``DeviceMesh._unflatten`` (torch
    2.9 and later; tests/distributed/test_parallel_mesh.py states it), else a mesh of its own over the same
    ranks in the same order (what ``init_device_mesh`` makes)."""
    if hasattr(world, "_unflatten"):
        return world._unflatten(0, sizes, names)
    return init_device_mesh(world.device_type, sizes, mesh_dim_names=names)


def build_mesh(layout: ParallelLayout, device_type: str) -> ParallelMesh:
    """The one mesh of ``layout`` on ``device_type`` (collective: every rank, the same layout)."""
    world = init_device_mesh(device_type, (layout.world,), mesh_dim_names=("world",))
    work = _unflatten(world, layout.work_sizes(), WORK_DIMS)
    weights = world if layout.replicas == 1 else _unflatten(world, layout.weight_sizes(), WEIGHT_DIMS)
    teams = None
    if layout.cfg > 1 and layout.ulysses > 1:
        team = layout.cfg * layout.ulysses
        teams = _unflatten(world, (layout.world // team, team), ("request_teams", "request_ranks"))
    return ParallelMesh(layout, world, work, weights, teams)
