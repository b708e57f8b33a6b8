"""The uint8 all-gather of FP8 codes over uneven shards, through a real process group.

Each rank holds ``torch.chunk``'s rows of one E4M3 weight (rows that do not divide by the
world, and fewer rows than ranks so that a rank holds none), hands them to
``StaticFloat8Tensor``'s FSDP2 pre-all-gather hook (bytes, padded to ``ceil(rows / world)``),
the process group all-gathers them, and the post hook views the bytes back as E4M3, once
fresh and once into the previous output (``out=``, FSDP2's buffer reuse). Every rank then
compares the gathered codes with the full codes (``bytes_equal``, ``out_reused_equal``) and,
with ``--reps``, times the round trip.

    torchrun --nproc-per-node N tests/gpu/uneven_allgather.py --report r.json [--reps 20] [--large]

NCCL with one GPU per rank where CUDA is there, else gloo on CPU. ``test_gpu_nccl.py`` asserts
the bytes; ``bench.gpu_smoke`` (section ``allgather``) records the timing and, under fake
CUDA with torch's fake process group, runs ``gather_case`` for its code path only.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

COLS = 128
LARGE_COLS = 5120  # one 64B-model projection's width


def cases(world: int, large: bool) -> list[tuple[int, int]]:
    """(rows, cols): fewer rows than ranks (zero-row ranks), uneven, and one even for contrast."""
    small = [(max(world - 1, 1), COLS), (3 * world + 1, COLS), (4 * world, COLS)]
    return small + ([(4 * LARGE_COLS + 3, LARGE_COLS)] if large else [])


class _Mesh:
    """What the hooks read from FSDP2's shard mesh: its size."""

    def __init__(self, n: int):
        self.n = n

    def size(self, dim: int = 0) -> int:
        return self.n


def _all_gather(out, inp, group):
    # torch 2.13 calls it all_gather_single; 2.10-2.12 have only all_gather_into_tensor.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _sync(device: torch.device, fake: bool) -> None:
    if device.type == "cuda" and not fake:
        torch.cuda.synchronize(device)


def gather_case(
    rows: int,
    cols: int,
    world: int,
    rank: int,
    device: torch.device,
    group=None,
    reps: int = 0,
    fake: bool = False,
    place=None,
) -> dict:
    """One weight of (rows, cols) through pre hook -> all-gather -> post hook on this rank.

    ``fake``: the tensors hold no data (fake CUDA, fake process group): the code path runs,
    nothing is compared or timed. ``place`` moves a CPU tensor to ``device`` (default ``.to``).
    """
    from fsdp_fp8.fp8.tensor import E4M3, make_static_fp8_weight, rebuild

    place = place or (lambda t: t.to(device))
    gen = torch.Generator().manual_seed(rows * 7919 + cols)
    full = place((torch.randn(rows, cols, generator=gen) * 50).clamp(-448, 448).to(E4M3))
    weight = make_static_fp8_weight(
        full, place(torch.tensor(0.01)), place(torch.tensor(0.02)), torch.bfloat16
    )  # scales on the codes' device, as the checkpoint loader puts them
    per_rank = -(-rows // world)
    start = min(rank * per_rank, rows)
    stop = min(start + per_rank, rows)
    local = rebuild(weight, full.narrow(0, start, stop - start).contiguous())
    (payload,), meta = local.fsdp_pre_all_gather(_Mesh(world), weight.shape, weight.stride(), None, None)
    gathered = torch.empty((world * payload.shape[0], *payload.shape[1:]), dtype=payload.dtype, device=device)
    _all_gather(gathered, payload, group)
    unsharded, _ = local.fsdp_post_all_gather((gathered,), meta, torch.bfloat16)
    record = {
        "rows": rows,
        "cols": cols,
        "world": world,
        "rank": rank,
        "local_rows": stop - start,
        "payload": [str(payload.dtype), list(payload.shape)],
        "padded_rows": per_rank,
        "bytes_sent": payload.numel() * payload.element_size(),
    }
    if fake:
        return record
    record["bytes_equal"] = torch.equal(unsharded.qdata.view(torch.uint8), full.view(torch.uint8))
    again = torch.empty_like(gathered)
    _all_gather(again, payload, group)
    local.fsdp_post_all_gather((again,), meta, torch.bfloat16, out=unsharded)
    record["out_reused_equal"] = torch.equal(unsharded.qdata.view(torch.uint8), full.view(torch.uint8))
    if reps:
        _sync(device, fake)
        t0 = time.perf_counter()
        for _ in range(reps):
            (payload,), meta = local.fsdp_pre_all_gather(_Mesh(world), weight.shape, weight.stride(), None, None)
            _all_gather(again, payload, group)
            local.fsdp_post_all_gather((again,), meta, torch.bfloat16, out=unsharded)
        _sync(device, fake)
        seconds = (time.perf_counter() - t0) / reps
        record["ms"] = round(seconds * 1e3, 4)
        # bytes every rank receives per gather / time: the collective's "algorithm bandwidth"
        record["gbps"] = round(gathered.numel() / seconds / 1e9, 3)
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report", required=True, help="rank 0 writes every rank's records here (JSON)")
    p.add_argument("--reps", type=int, default=0, help="timed round trips per case")
    p.add_argument("--large", action="store_true", help="add one 64B-model-sized weight (bandwidth)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        records = [gather_case(r, c, world, rank, device, reps=args.reps) for r, c in cases(world, args.large)]
        everyone = [None] * world
        dist.all_gather_object(everyone, records)
        if rank == 0:
            report = {"backend": dist.get_backend(), "world": world, "records": [r for rs in everyone for r in rs]}
            Path(args.report).parent.mkdir(parents=True, exist_ok=True)
            Path(args.report).write_text(json.dumps(report, indent=1))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from fsdp_fp8.runtime.shutdown import shutdown_distributed

    # not a finalizing exit: gloo's worker threads can abort it after the results (docs/shutdown.md)
    shutdown_distributed(main())
