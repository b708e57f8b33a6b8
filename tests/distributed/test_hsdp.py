"""HSDP: 4 gloo ranks as a 2 x 2 (replicate, shard) mesh, against the 1-D 4-rank and the
one-process loads of the same checkpoints.

One spawn observes everything (process start-up dominates on CPU): the mesh refusals, the
uneven model (rows 7, 16 and 1 do not divide by the shard size 2; the 1-row linear leaves
shard coordinate 1 empty) loaded, run, gathered and saved over the 2-D mesh and over the 1-D
one, and the reference MoT sampled both ways. The tests below judge those observations.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ranks import run_ranks
from small_models import HIDDEN, load_files, uneven_model_fn, write_uneven_checkpoint

REPLICAS, SHARDS = 2, 2
WORLD = REPLICAS * SHARDS
MOT_STEPS, MOT_LATENT = 3, 5
pytestmark = pytest.mark.timeout(600)


def _uneven_input() -> torch.Tensor:
    return torch.randn(3, 4, HIDDEN, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)


def _mot_ids() -> torch.Tensor:
    return torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(0))


def _mot_latent(model) -> torch.Tensor:
    from fsdp_fp8.runtime.sampler import sample

    return sample(model, _mot_ids(), steps=MOT_STEPS, seed=0, num_latent_tokens=MOT_LATENT)


def _refusal(load) -> str | None:
    from fsdp_fp8 import CheckpointError

    try:
        load()
    except CheckpointError as exc:
        return str(exc)
    return None


def _observe(rank: int, world: int, uneven: str, mot: str, saved: str) -> dict:
    from unittest import mock

    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from fsdp_fp8 import ParallelLayout, build_mesh, gather_state_dict, load_model, save_checkpoint
    from fsdp_fp8.load import reader
    from fsdp_fp8.runtime.allgather_meter import AllGatherMeter
    from fsdp_fp8.runtime.residency import apply_residency

    cpu = torch.device("cpu")
    obs: dict = {}

    def load_uneven(mesh):
        return load_model(uneven_model_fn, uneven, mesh, device=cpu)

    # Refused on every rank, before anything is sharded; the next load still works.
    obs["refused"] = {
        "3-D": _refusal(lambda: load_uneven(init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c")))),
        "no dim names": _refusal(lambda: load_uneven(init_device_mesh("cpu", (2, 2)))),
        "two of four ranks": _refusal(lambda: load_uneven(DeviceMesh("cpu", [0, 1]))),
    }

    def device_mesh(replicas: int = 1):  # the weight dims of the layout's one mesh
        return build_mesh(ParallelLayout(world, replicas=replicas), "cpu").weights

    hsdp_mesh, flat_mesh = device_mesh(REPLICAS), device_mesh()  # on every rank: collective
    obs["refused"]["2-D on ranks 0, 1; 1-D on 2, 3"] = _refusal(
        lambda: load_uneven(hsdp_mesh if rank < 2 else flat_mesh)
    )
    obs["refused"]["a CPU mesh for the meta device"] = _refusal(
        lambda: load_model(uneven_model_fn, uneven, hsdp_mesh, device=torch.device("meta"))
    )
    try:
        device_mesh(3)
        obs["replicas 3"] = None
    except ValueError as exc:
        obs["replicas 3"] = str(exc)

    mesh = device_mesh(REPLICAS)
    obs["coordinate"] = mesh.get_coordinate()
    totals: list[int] = []

    class Recorded(reader.LoadProgress):
        def __init__(self, total_bytes, **kwargs):
            totals.append(total_bytes)
            super().__init__(total_bytes, **kwargs)

    loaded = load_uneven(mesh)
    model = loaded.model
    obs["placements"] = sorted({str(p.placements) for p in model.parameters()})
    obs["bytes_read"] = loaded.report.bytes_read
    obs["local_rows"] = {
        t.module: model.get_submodule(t.module).weight._local_tensor.qdata.shape[0] for t in loaded.plan.fp8
    }
    residency = apply_residency(model, "none")
    x = _uneven_input()
    with torch.no_grad(), AllGatherMeter() as meter:
        obs["y"] = model(x)
    obs["all_gather_bytes"], obs["forecast_gather_bytes"] = meter.bytes, residency.first_forward_gather_bytes
    gathered = gather_state_dict(model)
    obs["gathered"] = gathered if rank == 0 else None
    obs["gathered_elsewhere"] = sorted(gathered) if rank != 0 else None
    obs["written"] = save_checkpoint(loaded, Path(saved) / "uneven").bytes_written

    flat = load_uneven(None)
    with torch.no_grad():
        obs["y_flat"] = flat.model(x)

    with mock.patch.object(reader, "LoadProgress", Recorded):
        hsdp = load_model(None, mot, mesh, device=cpu)
    obs["mot_progress_total"], obs["mot_bytes_read"] = totals[-1], hsdp.report.bytes_read
    with torch.no_grad():
        obs["mot_latent"] = _mot_latent(hsdp.model)
    flat = load_model(None, mot, device=cpu)
    with torch.no_grad():
        obs["mot_latent_flat"] = _mot_latent(flat.model)
    return obs


@pytest.fixture(scope="module")
def uneven_dir(tmp_path_factory):
    return write_uneven_checkpoint(tmp_path_factory.mktemp("uneven"))


@pytest.fixture(scope="module")
def mot_dir(tmp_path_factory):
    """The reference MoT (``tiny`` preset), calibrated on its own sampler, in several shards."""
    from fsdp_fp8.export.modelopt import export_fp8
    from fsdp_fp8.format.step_policy import PUBLISHED_POLICY
    from fsdp_fp8.models import PRESETS, build_model, init_weights
    from fsdp_fp8.runtime.sampler import sample

    model = init_weights(build_model(PRESETS["tiny"], device="cpu"), seed=0)
    return export_fp8(
        model,
        tmp_path_factory.mktemp("mot") / "ckpt",
        config=model.config.to_config_dict(),
        calibrate=lambda m: sample(m, _mot_ids(), steps=2, seed=0, num_latent_tokens=5),
        step_policy=PUBLISHED_POLICY,
        max_shard_size=60_000,
    )


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("saved")


@pytest.fixture(scope="module")
def observed(uneven_dir, mot_dir, saved_dir):
    return run_ranks(_observe, WORLD, str(uneven_dir), str(mot_dir), str(saved_dir), timeout=400)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def test_the_mesh_is_replicate_by_shard_and_fsdp2_places_every_parameter_so(observed):
    assert [obs["coordinate"] for obs in observed] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for obs in observed:
        assert obs["placements"] == ["(Replicate(), Shard(dim=0))"]


def test_gathered_state_equals_the_files_bit_for_bit(observed, uneven_dir):
    files, gathered = load_files(uneven_dir), observed[0]["gathered"]
    assert sorted(gathered) == sorted(files)
    assert [k for k in files if not _same_bytes(gathered[k], files[k])] == []
    assert all(obs["gathered_elsewhere"] == [] for obs in observed[1:])  # full tensors on rank 0 only


def test_each_rank_holds_and_reads_its_shard_coordinates_rows_only(observed, uneven_dir):
    files = load_files(uneven_dir)

    def rows_of(n: int, shard: int) -> int:  # torch.chunk over the shard dim, empty chunks included
        chunks = torch.arange(n).chunk(SHARDS)
        return chunks[shard].numel() if shard < len(chunks) else 0

    def shard_bytes(shard: int) -> int:
        total = 0
        for key, t in files.items():
            if key.endswith("_scale"):  # read when the checkpoint was opened, never again
                continue
            if key == "shift":  # a buffer: FSDP2 does not shard it, every rank reads it whole
                total += t.numel() * t.element_size()
                continue
            total += rows_of(t.shape[0], shard) * (t.numel() // t.shape[0]) * t.element_size()
        return total

    for rank, obs in enumerate(observed):
        shard = rank % SHARDS
        assert obs["bytes_read"] == shard_bytes(shard), rank
        for module, rows in obs["local_rows"].items():
            assert rows == rows_of(files[f"{module}.weight"].shape[0], shard), (rank, module)
    assert observed[1]["local_rows"]["layers.0.gate"] == 0  # a zero-row shard
    # Every byte read once per replica group.
    assert sum(obs["bytes_read"] for obs in observed) == REPLICAS * sum(shard_bytes(s) for s in range(SHARDS))


def test_all_gathers_run_over_the_shard_dim_and_match_the_residency_forecast(observed):
    # ceil(rows / 2) rows per parameter: what a 2-rank 1-D load sends, not ceil(rows / 4).
    def padded(rows, row_numel, itemsize):
        return -(-rows // SHARDS) * row_numel * itemsize

    block = (
        padded(HIDDEN, 1, 2)
        + padded(7, HIDDEN, 1)
        + padded(7, 1, 2)
        + padded(HIDDEN, 7, 1)
        + padded(1, HIDDEN, 1)
        + padded(1, 1, 2)
    )
    for obs in observed:
        assert obs["all_gather_bytes"] == 2 * block + padded(6, HIDDEN, 2)
        assert obs["forecast_gather_bytes"] == obs["all_gather_bytes"]


@pytest.fixture(scope="module")
def single_process(uneven_dir, mot_dir):
    import torch.distributed as dist

    from fsdp_fp8 import load_model

    assert not dist.is_initialized()
    cpu = torch.device("cpu")
    uneven = load_model(uneven_model_fn, uneven_dir, device=cpu).model
    mot = load_model(None, mot_dir, device=cpu).model
    with torch.no_grad():
        return {"y": uneven(_uneven_input()), "mot_latent": _mot_latent(mot)}


def test_forward_equals_the_1d_and_the_one_process_loads_bit_for_bit(observed, single_process):
    for obs in observed:
        assert torch.equal(obs["y"], obs["y_flat"])
        assert torch.equal(obs["y"], single_process["y"])
        assert torch.equal(obs["mot_latent"], obs["mot_latent_flat"])
        assert torch.equal(obs["mot_latent"], single_process["mot_latent"])


def test_progress_counts_the_shard_coordinates_bytes(observed):
    for obs in observed:
        assert obs["mot_progress_total"] == obs["mot_bytes_read"] > 0


def test_save_writes_each_row_once_from_rank_0s_replica(observed, uneven_dir, saved_dir):
    files, copy = load_files(uneven_dir), load_files(saved_dir / "uneven")
    assert sorted(copy) == sorted(files)
    assert [k for k in files if not _same_bytes(copy[k], files[k])] == []
    written = [obs["written"] for obs in observed]
    assert sum(written) == sum(t.numel() * t.element_size() for t in files.values())
    assert written[2:] == [0, 0]  # the other replica holds the same rows: it writes none


def test_a_mesh_fsdp_fp8_cannot_shard_over_is_refused_on_every_rank(observed):
    needles = {
        "3-D": "the mesh has 3 dimensions (1x2x2)",
        "no dim names": "has no mesh_dim_names",
        "two of four ranks": "is not built over the default process group's 4 ranks",
        "2-D on ranks 0, 1; 1-D on 2, 3": "ranks disagree on placement",
        "a CPU mesh for the meta device": "the mesh is on 'cpu' but the model loads onto 'meta'",
    }
    for obs in observed:
        for case, needle in needles.items():
            assert obs["refused"][case] is not None and needle in obs["refused"][case], (case, obs["refused"][case])
        assert "replicas 3 does not divide the world size 4" in obs["replicas 3"]
    # The same words on every rank: one agreed error, not a rank-local one.
    assert len({tuple(sorted(obs["refused"].items())) for obs in observed}) == 1
