"""Letting loaded models go: RSS over repeated loads in one process, per rank.

    python -m bench.release --mode close [--forward] [--size default] [--cycles 5]       # one rank
    torchrun --nproc-per-node 2 -m bench.release --mode close [--forward] ...           # gloo ranks

Each cycle loads the bench's FP8 checkpoint (``common.checkpoints``), runs one denoising
forward with ``--forward``, then lets the model go by ``--mode``:

- ``drop``: ``del loaded`` (all there was before ``LoadedModel.close()``): FSDP2's reference
  cycles keep the bytes until the garbage collector runs;
- ``close``: ``loaded.close()``, the model still referenced (as a pipeline references it);
- ``close-no-trim``: the same without ``malloc_trim`` (``release.trim_host_heap`` a no-op for
  this process): what glibc keeps of the freed bytes.

Records RSS and anonymous RSS (``/proc/self/status`` RssAnon) before the first load, after each
load and after each let-go; the bar is "within 5% of one load's bytes (``bytes_held``) above the
start after the last cycle". Then, once, after ``gc.collect()`` and a trim: RSS, and the
file-backed part of it (library code paged in by the first load). Beside RSS, glibc's own count
of the bytes malloc has handed out (``mallinfo2``): what is held, as opposed to what glibc keeps
free for reuse. One JSON line per rank in ``bench/results.jsonl``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist

from bench import common, harness
from fsdp_fp8 import load_model
from fsdp_fp8.load import release
from fsdp_fp8.runtime.shutdown import shutdown_distributed

MODES = ("drop", "close", "close-no-trim")


def status_bytes(field: str = "RssAnon") -> int:
    """A size from ``/proc/self/status``: ``RssAnon`` (anonymous: heap, arenas, Python's objects),
    ``RssFile`` (file-backed: the code of the libraries, paged in on first use)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def heap_in_use() -> int:
    """Bytes glibc's malloc has handed out and not had back (``mallinfo2``: in arenas and mmapped):
    what the process holds, apart from what glibc keeps free for reuse; -1 without glibc 2.33+."""
    info = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if info is None:
        return -1
    info.restype = _MallInfo2
    m = info()
    return m.uordblks + m.hblkhd


def cycle(path: Path, mode: str, forward: bool) -> dict:
    """One load -> (forward) -> let go; the memory after the load and after the let-go."""
    loaded = load_model(None, path, device=torch.device("cpu"))
    if forward:
        cfg = loaded.model.config
        with torch.no_grad():
            loaded.model.denoise(torch.zeros(1, 64, cfg.latent_channels), torch.tensor([0.5]), None)
    out = {"loaded_rss": common.rss_bytes(), "held": loaded.report.bytes_held}
    if mode == "drop":
        del loaded
    else:
        loaded.close()
    out.update(rss=common.rss_bytes(), anon=status_bytes(), heap=heap_in_use())
    return out


def checkpoint(size: str, root: str | None) -> Path:
    """The bench's FP8 checkpoint, exported (the first time) in a child process: the export's
    own memory must not be in this process's heap when the measurement starts."""
    code = f"from bench import common; print(common.checkpoints({size!r}, {root!r})[0])"
    out = subprocess.run([sys.executable, "-c", code], cwd=harness.ROOT, check=True,
                         capture_output=True, text=True)  # fmt: skip
    return Path(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--forward", action="store_true", help="one denoising forward per load")
    p.add_argument("--size", choices=sorted(common.SIZES), default="default")
    p.add_argument("--cycles", type=int, default=5)
    p.add_argument("--dir")
    p.add_argument("--out", default=str(common.RESULTS))
    args = p.parse_args(argv)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    box = [checkpoint(args.size, args.dir) if rank == 0 else None]
    if distributed:
        dist.broadcast_object_list(box)
    untrimmed = mock.patch.object(release, "trim_host_heap", lambda: False) if args.mode == "close-no-trim" else None
    try:
        if untrimmed:
            untrimmed.start()
        start, start_anon, start_file = common.rss_bytes(), status_bytes(), status_bytes("RssFile")
        start_heap = heap_in_use()
        cycles = [cycle(box[0], args.mode, args.forward) for _ in range(args.cycles)]
        gc.collect()  # what the collector then frees: the dropped models' Python objects
        release.trim_host_heap()
        collected = {
            "rss": common.rss_bytes() - start,
            "file": status_bytes("RssFile") - start_file,
            "heap_in_use": heap_in_use() - start_heap,
        }
    finally:
        if untrimmed:
            untrimmed.stop()
    record = report(args, rank, start, start_anon, cycles) | {"after_gc": collected, "start_heap_in_use": start_heap}
    print(
        f"rank {rank} {args.mode}{' +forward' if args.forward else ''}: start {common.mib(start)} MiB, one load "
        f"{common.mib(record['one_load_bytes'])} MiB; after each: "
        + ", ".join(common.mib(c["rss"] - start) for c in cycles)
        + f" MiB (anon {', '.join(common.mib(c['anon'] - start_anon) for c in cycles)}); "
        f"within 5%: {record['within_5pct']}; then gc: {common.mib(collected['rss'])} MiB "
        f"(file-backed {common.mib(collected['file'])}); malloc's bytes in use after each: "
        + ", ".join(common.mib(c["heap"] - start_heap) for c in cycles)
        + f", then gc: {common.mib(collected['heap_in_use'])} MiB",
        flush=True,
    )
    common.append_jsonl(args.out, [record])
    return 0


def report(args, rank: int, start: int, start_anon: int, cycles: list[dict]) -> dict:
    one_load = min(c["held"] for c in cycles)
    last = cycles[-1]["rss"] - start
    return {
        "bench": "release",
        "mode": args.mode,
        "forward": args.forward,
        "size": args.size,
        "world": dist.get_world_size() if dist.is_initialized() else 1,
        "rank": rank,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "load_average": os.getloadavg()[0],
        "start_rss": start,
        "one_load_bytes": one_load,
        "after_rss": [c["rss"] - start for c in cycles],
        "after_anon": [c["anon"] - start_anon for c in cycles],
        "heap_in_use": [c["heap"] for c in cycles],  # absolute; start_heap_in_use beside
        "loaded_rss": [c["loaded_rss"] - start for c in cycles],
        "within_5pct": last <= 0.05 * one_load,
    }


if __name__ == "__main__":
    # Destroys the group and leaves through os._exit after flushing (docs/shutdown.md).
    shutdown_distributed(main())
