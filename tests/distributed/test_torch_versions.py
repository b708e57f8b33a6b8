"""torch 2.10 through 2.13: the older-torch paths, forced on whatever torch runs the suite.

What differs across the range and what we do (docs/compatibility.md):
- ``torch.distributed.all_gather_single`` exists from 2.13 (FSDP2 calls it there); 2.10-2.12
  have only ``all_gather_into_tensor`` (FSDP2 calls that): ``fsdp_fp8.runtime.allgather_meter``.
- the CPU ``torch._scaled_mm`` takes per-row scales from 2.13 only: tests/distributed/test_ptq.py.
- a torch older than 2.10 is refused when the package is imported.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from calibration import bound
from ranks import run_ranks

ROOT = Path(__file__).resolve().parents[2]


def _import_with_torch_version(version: str) -> subprocess.CompletedProcess:
    code = f"import torch; torch.__version__ = {version!r}; import fsdp_fp8"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=bound(120))


@pytest.mark.parametrize("version", ["2.9.1", "2.9.0a0+git1234", "1.13.1"])
def test_an_older_torch_is_refused_at_import(version):
    proc = _import_with_torch_version(version)
    assert proc.returncode != 0
    assert "ImportError: fsdp_fp8 needs torch >= 2.10" in proc.stderr, proc.stderr[-2000:]
    assert f"has torch {version}" in proc.stderr


@pytest.mark.parametrize("version", ["2.10.0", "2.10.0+cu128", "2.11.0a0+gitabc", "3.0.0"])
def test_the_supported_range_imports(version):
    proc = _import_with_torch_version(version)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _gather_without_all_gather_single(rank, world):
    """torch 2.10-2.12 as far as the collective goes: no ``all_gather_single``."""
    import torch.distributed as dist

    from fsdp_fp8.runtime import allgather_meter as collectives

    if hasattr(dist, "all_gather_single"):  # torch 2.13: hide it, as older torch lacks it
        del dist.all_gather_single
    name = collectives.all_gather_name()
    rows = 3 if rank == 0 else 2  # uneven inputs are padded by the caller, as FSDP2 does
    local = torch.zeros(3, 5, dtype=torch.uint8)
    local[:rows] = rank + 1
    out = torch.empty(3 * world, 5, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # 2.13 deprecates the old name
        with collectives.AllGatherMeter() as meter:
            collectives.all_gather_into(out, local)
            # What FSDP2 does on torch <= 2.12: call the module attribute itself.
            dist.all_gather_into_tensor(out, local)
    return {"name": name, "sizes": meter.sizes, "out": out}


def test_the_all_gather_fallback_is_used_and_counted_without_all_gather_single():
    results = run_ranks(_gather_without_all_gather_single, 2, timeout=60)
    expected = torch.cat(
        [
            torch.full((3, 5), 1, dtype=torch.uint8),
            torch.cat([torch.full((2, 5), 2, dtype=torch.uint8), torch.zeros(1, 5, dtype=torch.uint8)]),
        ]
    )
    for r in results:
        assert r["name"] == "all_gather_into_tensor"
        assert r["sizes"] == [15, 15]  # both calls counted, each once: 3 x 5 bytes sent
        assert torch.equal(r["out"], expected)


def _gather_native(rank, world):
    import torch.distributed as dist

    from fsdp_fp8.runtime import allgather_meter as collectives

    out = torch.empty(world * 4, dtype=torch.int64)
    with collectives.AllGatherMeter() as meter:
        collectives.all_gather_into(out, torch.full((4,), rank))
        # On 2.13 the old name forwards to the new one: still one count per collective.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_gather_into_tensor(out, torch.full((4,), rank))
    return {
        "name": collectives.all_gather_name(),
        "sizes": meter.sizes,
        "out": out,
        "has_single": hasattr(dist, "all_gather_single"),
    }


def test_the_meter_counts_each_collective_once_on_this_torch():
    for r in run_ranks(_gather_native, 2, timeout=60):
        assert r["name"] == ("all_gather_single" if r["has_single"] else "all_gather_into_tensor")
        assert r["sizes"] == [32, 32]
        assert torch.equal(r["out"], torch.tensor([0] * 4 + [1] * 4))


def test_the_meter_replaces_no_function_of_torch_distributed():
    import torch.distributed as dist

    from fsdp_fp8.runtime import allgather_meter as collectives

    def functions():
        return {name: getattr(dist, name) for name in collectives.NAMES if hasattr(dist, name)}

    before = functions()
    with collectives.AllGatherMeter():
        during = functions()
    assert during == before  # another thread's all-gathers, or a second meter, see torch's own


@pytest.mark.parametrize(("local_rank", "count", "index"), [("0", 1, 0), ("3", 1, 0), ("9", 8, 1), ("7", 8, 7)])
def test_local_rank_maps_onto_the_visible_gpus(monkeypatch, local_rank, count, index):
    from fsdp_fp8.load.options import local_cuda_index

    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert local_cuda_index() == index
