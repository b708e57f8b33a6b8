"""bench.peer_load kept working: the peer methods (DCP's HuggingFaceStorageReader, rank-0
load + broadcast) really load the files' bytes into every rank's shards, the strict floor
reads each byte once across the ranks, and the whole bench runs on a tiny Llama-shaped
ModelOpt checkpoint in seconds with every method's bytes as forecast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ranks import run_ranks
from safetensors.torch import load_file

from bench import harness, peer_checkpoints
from bench import peer_load as peer


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("llama") / "fp8"
    return peer_checkpoints.write_llama_checkpoint(peer_checkpoints.SHAPES["llama-tiny"], directory)


def _file_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def _load_and_compare(rank: int, world: int, directory: str, method: str) -> list[str]:
    """This rank's shards after ``method``, compared byte for byte with its rows of the files."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    directory = Path(directory)
    phases = harness.Phases()
    fn = {"dcp": peer.method_dcp, "bcast": peer.method_bcast}[method]
    model = fn(directory, phases, {"threads": 2})["_keep"]
    state = model.state_dict()
    files = _file_tensors(directory)
    wrong = sorted(set(files) ^ set(state))
    for key, value in files.items():
        if key not in state:
            continue
        dest = state[key]
        if isinstance(dest, DTensor):
            shape, offset = compute_local_shape_and_global_offset(dest.shape, dest.device_mesh, dest.placements)
            start = offset[0] if shape[0] else 0
            value, dest = value[start : start + shape[0]], dest._local_tensor
        if dest.dtype != value.dtype and not (dest.dtype == torch.uint8 and value.dtype == torch.float8_e4m3fn):
            wrong.append(f"{key}: {dest.dtype} vs {value.dtype}")
            continue
        if not torch.equal(dest.reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)):
            wrong.append(key)
    assert sum(phases.seconds.values()) > 0
    return wrong


@pytest.mark.parametrize("method", ["dcp", "bcast"])
def test_the_peer_methods_load_the_files_bytes_into_every_rank(tiny_llama, method):
    # 3 ranks: the 301-row embedding and head split unevenly
    results = run_ranks(_load_and_compare, 3, str(tiny_llama), method, timeout=180)
    assert results == [[], [], []]


def test_the_strict_floor_reads_every_byte_once_across_the_ranks():
    files = [("a", 10), ("b", 3), ("c", 7)]
    shares = [6, 6, 8]
    seen = []
    for rank, n in enumerate(shares):
        pieces = peer.floor_span(files, sum(shares[:rank]), n)
        assert sum(length for _, _, length in pieces) == n
        seen += [(path, offset + i) for path, offset, length in pieces for i in range(length)]
    assert sorted(seen) == sorted((path, i) for path, size in files for i in range(size))


def test_the_bench_runs_every_method_with_the_forecast_bytes(tiny_llama, tmp_path):
    results = tmp_path / "r.jsonl"
    whatif = "fsdp_fp8+noprefetch+nocheck"
    methods = [*peer.METHODS, whatif, "floor-2"]
    # one world size: each method and world is a fresh job of its own; 2 ranks split every tensor
    argv = ["--checkpoints", str(tiny_llama), "--worlds", "2", "--cache", "cold", "--reps", "1"]
    assert peer.main([*argv, "--methods", ",".join(methods), "--results", str(results)]) == 0
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert {(r["world_size"], r["method"]) for r in rows} == {(2, m) for m in methods}
    for r in rows:  # the what-if took the prefetch away; the default hints every row of the rank
        if r["method"] == whatif:
            assert r["prefetch_bytes_per_rank"] == [0] * r["world_size"]
        elif r["method"] == "fsdp_fp8":
            assert r["prefetch_bytes_per_rank"] == r["row_bytes_per_rank"] and r["code_check_thread_s_median"] > 0
    files = _file_tensors(tiny_llama)
    total = sum(t.numel() * t.element_size() for t in files.values())
    scales = sum(4 for t in files.values() if t.ndim == 0)
    for r in rows:
        rows_bytes = r["row_bytes_per_rank"]
        assert sum(rows_bytes) == total - scales
        asked = r["bytes_asked_per_rank"]
        if r["method"].startswith("floor"):
            assert asked == rows_bytes
        elif r["method"].startswith(("fsdp_fp8", "dcp")):  # + every 0-d scale, on every rank
            assert asked == [b + scales for b in rows_bytes], r["method"]
        else:  # bcast: rank 0 reads everything
            assert asked == [total] + [0] * (r["world_size"] - 1)
        assert len(r["seconds_all"]) == 1 and r["phases_median"]
    fsdp = next(r for r in rows if r["method"] == "fsdp_fp8" and r["world_size"] == 2)
    assert {"open", "plan", "fully_shard", "reads"} <= set(fsdp["phases_median"]), fsdp["phases_median"]
    assert fsdp["phases_missing"] == []
    table = peer.report(str(results))  # the Markdown that docs/benchmarks.md holds
    assert "| fsdp_fp8 |" in table and f"| {tiny_llama} | 2 | cold |" in table
