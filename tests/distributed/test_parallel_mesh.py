"""The one mesh of a parallel layout (``runtime.parallel_mesh.build_mesh``): its weight and work
dims over gloo ranks, at 4 ranks (HSDP 2 x 2, CFG 2 x Ulysses 2) and at 1, the same ranks
whether torch's ``DeviceMesh._unflatten`` cuts it or the fallback does; and no process group made
by hand anywhere else in the package."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from ranks import run_ranks

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_fp8"
DIMS = ("request", "cfg", "ulysses", "replicate", "shard")


def _slices(mesh) -> dict:
    dims = DIMS if mesh.layout.replicas > 1 else DIMS[:-2] + ("shard",)  # no replicate dim without HSDP
    return {name: mesh[name].mesh.tolist() for name in dims}


def _observe(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import DeviceMesh

    from fsdp_fp8 import ParallelLayout, build_mesh

    replicas, cfg, ulysses = (2, True, 2) if world == 4 else (1, False, 1)
    layout = ParallelLayout(world, cfg_parallel=cfg, ulysses=ulysses, replicas=replicas)
    mesh = build_mesh(layout, "cpu")
    obs = {
        "slices": _slices(mesh),
        "work": mesh.work.get_coordinate(),
        "weights": mesh.weights.get_coordinate(),
        "layout": tuple(layout.coordinates(rank)),
        "names": (mesh.work.mesh_dim_names, mesh.weights.mesh_dim_names),
    }
    unflatten = DeviceMesh._unflatten
    del DeviceMesh._unflatten  # a torch before 2.9: the fallback, over the same ranks
    try:
        obs["fallback"] = _slices(build_mesh(layout, "cpu"))
    finally:
        DeviceMesh._unflatten = unflatten
    return obs


@pytest.fixture(scope="module")
def observed():
    return {world: run_ranks(_observe, world, timeout=300) for world in (1, 4)}


def test_each_dim_is_the_layouts_ranks_ulysses_innermost_and_a_replica_of_neighbours(observed):
    rank2 = observed[4][2]["slices"]
    assert rank2["ulysses"] == [2, 3] and rank2["cfg"] == [0, 2] and rank2["request"] == [2]
    assert rank2["shard"] == [2, 3] and rank2["replicate"] == [0, 2]
    for rank, obs in enumerate(observed[4]):
        assert tuple(obs["work"]) == obs["layout"]
        assert tuple(obs["weights"]) == divmod(rank, 2)
        assert obs["names"] == (("request", "cfg", "ulysses"), ("replicate", "shard"))
        assert obs["fallback"] == obs["slices"], rank


def test_one_rank_is_a_mesh_of_one(observed):
    (one,) = observed[1]
    assert one["slices"] == {name: [0] for name in ("request", "cfg", "ulysses", "shard")}
    assert one["fallback"] == one["slices"]
    assert one["names"][1] == ("world",)  # FSDP over every rank: the world mesh itself


def test_the_mesh_builder_relies_on_torchs_unflatten():
    """The fact ``build_mesh`` uses where torch has it (2.9 and later): a named, row-major cut."""
    import inspect

    from torch.distributed.device_mesh import DeviceMesh

    assert list(inspect.signature(DeviceMesh._unflatten).parameters)[:4] == [
        "self",
        "dim",
        "mesh_sizes",
        "mesh_dim_names",
    ]


def test_no_module_makes_process_groups_by_hand_but_the_agreements_side_group():
    found = [
        f"{p.relative_to(PACKAGE)}:{i}"
        for p in sorted(PACKAGE.rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\bnew_group\(", line) and "``new_group``" not in line
    ]
    assert [f.split(":")[0] for f in found] == ["collective/group.py"], found
