"""Sections ``allgather`` and ``alltoall``: the uint8 all-gather of uneven shards and Ulysses
attention's all-to-alls, under torchrun at the largest world the box allows (``--dry``: gloo on
CPU), the workers in tests/gpu; on fake CUDA the all-gather hooks through a fake world of 8."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from bench import harness
from bench.gpu_smoke.context import BAD_LINES, Context
from bench.harness import ROOT


def _allgather_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("uneven_allgather", ROOT / "tests" / "gpu" / "uneven_allgather.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_script(ctx: Context, r: dict, world: int, script: str, reps: int) -> dict | None:
    """``script`` under torchrun on ``world`` ranks (``--dry``: 2 repetitions, small sizes, one
    thread a rank); its exit and warning lines into ``r``; its JSON report, or None (``r`` failed)."""
    with tempfile.TemporaryDirectory(prefix="fsdp_fp8-smoke-") as tmp:
        report = Path(tmp) / "report.json"
        args = ["--report", str(report), "--reps", "2" if ctx.dry else str(reps)] + ([] if ctx.dry else ["--large"])
        env = dict(os.environ, OMP_NUM_THREADS="1") if ctx.dry else None
        rc, text = harness.torchrun(world, script, *args, env=env)
        r.update(exit=rc, bad_lines=[x for x in text.splitlines() if BAD_LINES.search(x)][:10])
        if rc != 0 or not report.exists():
            r.update(status="failed", tail=text[-3000:])
            return None
        return json.loads(report.read_text())


def section_allgather(ctx: Context) -> None:
    import torch

    worker = _allgather_module()
    if ctx.fake:
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        world = 8
        for rank in (0, world - 1):  # a rank with rows and one with none
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
            try:
                for rows, cols in worker.cases(world, large=False):
                    with ctx.variant(f"fake world {world} rank {rank} rows {rows}") as r:
                        r.update(worker.gather_case(rows, cols, world, rank, ctx.device, fake=True, place=ctx.place))
            finally:
                dist.destroy_process_group()
        ctx.skip("torchrun", "the collective's bytes and time need real ranks (--dry: gloo, CUDA: NCCL)")
        return
    world = torch.cuda.device_count() if ctx.device.type == "cuda" else 3
    with ctx.variant(f"world {world}") as r:
        got = _run_script(ctx, r, world, "tests/gpu/uneven_allgather.py", reps=20)
        if got is None:
            return
        rank0 = [x for x in got["records"] if x["rank"] == 0]
        r.update(backend=got["backend"], world=got["world"])
        r["cases"] = [{k: x.get(k) for k in ("rows", "cols", "padded_rows", "ms", "gbps")} for x in rank0]
        r["zero_row_ranks"] = sorted({x["rank"] for x in got["records"] if x["local_rows"] == 0})
        # reported, not judged: tests/gpu/test_gpu_nccl.py asserts the bytes
        r["bytes_equal_everywhere"] = all(x["bytes_equal"] and x["out_reused_equal"] for x in got["records"])


def section_alltoall(ctx: Context) -> None:
    import torch

    if ctx.fake:
        ctx.skip("torchrun", "a real collective between ranks; the local packing runs on fake CUDA in the CPU suite")
        return
    world = torch.cuda.device_count() if ctx.device.type == "cuda" else 3
    if world < 2:
        ctx.skip("torchrun", f"{world} GPU: a Ulysses group needs two (NCCL refuses two ranks on one GPU)")
        return
    with ctx.variant(f"world {world}") as r:
        got = _run_script(ctx, r, world, "tests/gpu/ulysses_all_to_all.py", reps=10)
        if got is None:
            return
        r.update(backend=got["backend"], world=got["world"])
        rank0 = [x for x in got["records"] if x["rank"] == 0]
        r["cases"] = [{k: x.get(k) for k in ("rows", "heads", "chunk", "ms", "gbps")} for x in rank0]
        # reported, not judged: tests/gpu/test_gpu_nccl.py asserts the rows and heads
        r["rows_equal_everywhere"] = all(x["heads_equal"] and x["round_trip_equal"] for x in got["records"])
