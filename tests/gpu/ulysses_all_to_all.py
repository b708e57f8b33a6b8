"""Ulysses attention's all-to-alls through a real process group: each rank's generation rows
of q/k/v (every head) to every row of its heads (``Ulysses.to_heads``) and an output
back (``to_rows``), at an uneven row count (padding dropped and restored). Every rank checks that
the round trip gives its rows back and that its heads hold every rank's rows in order
(``round_trip_equal``, ``heads_equal``) and, with ``--reps``, times the pair.

    torchrun --nproc-per-node N tests/gpu/ulysses_all_to_all.py --report r.json [--reps 20] [--large]

NCCL with one GPU per rank where CUDA is there, else gloo on CPU. ``test_gpu_nccl.py`` asserts
the bytes; ``bench.gpu_smoke`` (section ``alltoall``) records the timing.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

LARGE = (44160, 64, 8, 128)  # (generation rows, heads, key/value heads, head dim): the 64B model, 720p video


def shapes(world: int, large: bool) -> list[tuple[int, int, int, int]]:
    """Rows that do not divide by the world and fewer than 16 per rank (padding), heads it divides;
    the 64B model's shape where the world divides its key/value heads."""
    small = [(7 * world + 3, 2 * world, world, 16), (5, 2 * world, world, 16)]
    return small + ([LARGE] if large and LARGE[2] % world == 0 else [])


def case(length: int, heads: int, kv_heads: int, dim: int, device: torch.device, reps: int = 0) -> dict:
    from fsdp_fp8.interop.ulysses import Ulysses

    world, rank = dist.get_world_size(), dist.get_rank()
    sequence = Ulysses(dist.group.WORLD, rank, world)
    sequence.length, sequence.chunk = length, sequence.rows(length)
    gen = torch.Generator().manual_seed(length)
    full = [
        torch.randn(length, n, dim, generator=gen).to(torch.bfloat16).to(device) for n in (heads, kv_heads, kv_heads)
    ]
    mine = [sequence._slice(t) for t in full]
    q, k, v = sequence.to_heads(*mine)
    heads_equal = all(torch.equal(got, sequence.my_heads(t)) for got, t in zip((q, k, v), full))
    back = sequence.to_rows(q)
    record = {
        "rows": length,
        "heads": heads,
        "world": world,
        "rank": rank,
        "chunk": sequence.chunk,
        "heads_equal": heads_equal,
        "round_trip_equal": torch.equal(back, mine[0]),
    }
    if reps:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            q, k, v = sequence.to_heads(*mine)
            sequence.to_rows(q)
        _sync(device)
        seconds = (time.perf_counter() - t0) / reps
        sent = sum(t.numel() * t.element_size() for t in mine) + back.numel() * back.element_size()
        record.update(ms=round(seconds * 1e3, 4), gbps=round(sent / seconds / 1e9, 3))
    return record


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report", required=True, help="rank 0 writes every rank's records here (JSON)")
    p.add_argument("--reps", type=int, default=0, help="timed round trips per case")
    p.add_argument("--large", action="store_true", help="add the 64B model's 720p video shape (bandwidth)")
    args = p.parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        records = [case(*shape, device, args.reps) for shape in shapes(dist.get_world_size(), args.large)]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, records)
        if dist.get_rank() == 0:
            out = {"backend": dist.get_backend(), "world": dist.get_world_size(), "records": sum(everyone, [])}
            Path(args.report).write_text(json.dumps(out, indent=1))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from fsdp_fp8.runtime.shutdown import shutdown_distributed

    # not a finalizing exit: gloo's worker threads can abort it after the results (docs/shutdown.md)
    shutdown_distributed(main())
