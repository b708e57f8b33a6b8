"""The reader alone: fsdp_fp8's read schedule against the single-thread pread floor of the same
bytes, warm and cold page cache, beside this machine's memory-copy limit.

    python -m bench.reader [--size default] [--world 2 --rank 0] [--reps 5] [--threads 1,2,4]

Variants (interleaved: the order rotates each repetition; medians reported):
  floor        one thread, one ``preadv`` per tensor range, sorted by file and offset
  reader xT    ``read_schedule.schedule`` + ``run`` with T threads (in flight 2T), the loader's path
  memcpy xT    ``memmove`` of the same number of bytes between two touched buffers, T threads:
               a warm read is a copy out of the page cache, so this bounds it
Every variant writes into the same preallocated, touched buffer (no page faults timed). Cold:
``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file before each cold trial (checked with
``fincore``; no root needed, and it leaves other users' caches alone). The bytes are the rows
rank ``--rank`` of ``--world`` reads under Shard(0) (every tensor but the 0-d scales).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from bench import common, harness
from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.reading import read_schedule, slice_reader
from fsdp_fp8.shard_rows import chunk_rows


def rank_ranges(ckpt, world: int, rank: int):
    out = []
    for entry in ckpt.tensors.values():
        if not entry.shape:
            continue  # 0-d scales: read at open, never by the load
        start, stop = chunk_rows(entry.shape[0], world, rank)
        offset, n = slice_reader.row_range(entry, start, stop)
        if n:
            out.append((entry, offset, n))
    return sorted(out, key=lambda r: (r[0].file, r[1]))


def floor(ranges, view: memoryview) -> int:
    at = 0
    for entry, offset, n in ranges:
        fd, done = entry.handle.fileno(), 0
        while done < n:
            got = os.preadv(fd, [view[at + done : at + n]], offset + done)
            assert got, "file ended"
            done += got
        at += n
    return at


def reader(ranges, view: memoryview, threads: int) -> int:
    pieces, at = [], 0
    for entry, offset, n in ranges:
        pieces.append(read_schedule.Piece(entry, offset, n, view, at))
        at += n
    before = slice_reader.bytes_read()
    problems = read_schedule.run(read_schedule.schedule(pieces), threads=threads, in_flight=2 * threads)
    assert not problems, problems
    return slice_reader.bytes_read() - before


def memcpy(src: torch.Tensor, dst: torch.Tensor, threads: int) -> int:
    n = src.numel()
    step = -(-n // threads)

    def part(lo):  # ctypes releases the GIL for the call
        ctypes.memmove(dst.data_ptr() + lo, src.data_ptr() + lo, min(step, n - lo))

    workers = [threading.Thread(target=part, args=(lo,)) for lo in range(0, n, step)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(common.SIZES), default="default")
    p.add_argument("--dir", help="benchmark checkpoint cache (see bench/common.py)")
    p.add_argument("--checkpoint", help="read this FP8 checkpoint directory instead of the cached one")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", default="1,2,4")
    p.add_argument("--caches", default="warm,cold")
    p.add_argument("--results", default=str(common.RESULTS))
    args = p.parse_args(argv)
    fp8_dir = Path(args.checkpoint) if args.checkpoint else common.checkpoints(args.size, args.dir)[0]
    ckpt = open_checkpoint(fp8_dir)
    ranges = rank_ranges(ckpt, args.world, args.rank)
    total = sum(n for _, _, n in ranges)
    dst = torch.zeros(total, dtype=torch.uint8)  # zeros: touched, so no page fault is timed
    src = torch.ones(total, dtype=torch.uint8)
    view = slice_reader.writable(dst)
    threads = [int(t) for t in args.threads.split(",")]
    variants = {"floor": lambda: floor(ranges, view)}
    variants.update({f"reader x{t}": (lambda t=t: reader(ranges, view, t)) for t in threads})
    load0 = os.getloadavg()
    times: dict[tuple[str, str], list[float]] = {}
    cold_ok = True
    for rep in range(args.reps):
        for cache in args.caches.split(","):
            if cache == "warm":
                floor(ranges, view)  # every page in the cache
            for name in harness.rotated(list(variants), rep):
                if cache == "cold":
                    cold_ok = common.drop_page_cache([fp8_dir]) and cold_ok
                t0 = time.perf_counter()
                got = variants[name]()
                times.setdefault((cache, name), []).append(time.perf_counter() - t0)
                assert got == total, (name, got, total)
        for t in threads:
            t0 = time.perf_counter()
            memcpy(src, dst, t)
            times.setdefault(("-", f"memcpy x{t}"), []).append(time.perf_counter() - t0)
    load1 = os.getloadavg()
    print(
        f"{total / 2**20:,.1f} MiB (rank {args.rank} of {args.world}, {len(ranges)} ranges, "
        f"{len(ckpt.files)} files), {os.cpu_count()} CPUs, load average {load0[0]:.1f} -> {load1[0]:.1f}, "
        f"cold cache evicted: {cold_ok}, {args.reps} reps"
    )
    rows = []
    for (cache, name), ts in times.items():
        med = statistics.median(ts)
        base = times.get((cache, "floor"))
        rows.append(
            {
                "bench": "reader",
                "cache": cache,
                "variant": name,
                "seconds_median": med,
                "seconds_all": [round(t, 4) for t in ts],
                "gb_per_s": total / med / 1e9,
                "x_floor": statistics.median(base) / med if base else None,
                "bytes": total,
                "world": args.world,
                "rank": args.rank,
                "load_average": [round(load0[0], 1), round(load1[0], 1)],
                "cold_evicted": cold_ok,
                "cpus": os.cpu_count(),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }
        )
        x = f"{rows[-1]['x_floor']:.2f} x floor" if base else ""
        print(f"{cache:>5} {name:<11} {med:8.4f} s  {rows[-1]['gb_per_s']:6.2f} GB/s  {x}")
    common.append_jsonl(args.results, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
