"""Where fsdp_fp8's load time goes, phase by phase, per rank (what bench/load.py's a/d hides).

    torchrun --nproc-per-node 4 -m bench.load_phases [--size default]

Phases between barriers: open_checkpoint, meta build, plan, FP8 swap, fully_shard, to_empty
(materialize), and the rank-slice reads (``reader.read_rows``: every pread of this rank,
without the final agreement; the preadv time is summed over the reader's threads). The checkpoint is evicted from the page cache before the reads.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import torch.distributed as dist

from bench import common, harness
from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.interop.architectures import resolve_model_spec
from fsdp_fp8.load import reader
from fsdp_fp8.load.fsdp_wrap import default_mesh, shard_model
from fsdp_fp8.load.meta_build import materialize, meta_init
from fsdp_fp8.load.plan import plan_load
from fsdp_fp8.load.swap import swap_fp8_linears
from fsdp_fp8.reading import slice_reader
from fsdp_fp8.runtime.shutdown import shutdown_distributed


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--size", choices=sorted(common.SIZES), default="default")
    p.add_argument("--dir")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    fp8_dir = common.checkpoints(args.size, args.dir)[0] if rank == 0 else None
    box = [fp8_dir]
    dist.broadcast_object_list(box)
    fp8_dir = box[0]
    phases = harness.Phases()

    def phase(name, fn):  # every rank starts each phase together
        dist.barrier()
        return phases.run(name, fn)

    if rank == 0:
        common.drop_page_cache([fp8_dir])
    ckpt = phase("open_checkpoint", lambda: open_checkpoint(fp8_dir))
    with meta_init():
        model = phase("meta build", lambda: resolve_model_spec(ckpt.config).model_fn(ckpt.config))
    plan = phase("plan", lambda: plan_load(ckpt, model))
    phase("swap", lambda: swap_fp8_linears(model, plan))
    phase("fully_shard", lambda: shard_model(model, default_mesh("cpu")))
    phase("to_empty", lambda: materialize(model, torch.device("cpu")))
    if rank == 0:
        common.drop_page_cache([fp8_dir])
    pread = [0.0]
    real = slice_reader.preadv_into
    lock = threading.Lock()

    def timed(*args):  # summed over the reader's threads: can exceed the phase's wall time
        t = time.perf_counter()
        out = real(*args)
        with lock:  # the reader's workers call this at once
            pread[0] += time.perf_counter() - t
        return out

    slice_reader.preadv_into = timed
    with torch.no_grad():
        phase("reads", lambda: reader.read_rows(model, plan))
    slice_reader.preadv_into = real
    seconds = {**phases.seconds, "  of which in preadv": pread[0]}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, seconds)
    if rank == 0:
        print(f"{'phase':<22}" + "".join(f"{'rank ' + str(r):>10}" for r in range(len(gathered))))
        for name in seconds:
            print(f"{name:<22}" + "".join(f"{g[name]:>10.3f}" for g in gathered))
    dist.barrier()
    return 0


if __name__ == "__main__":
    # Destroys the group and leaves through os._exit after flushing (docs/shutdown.md).
    shutdown_distributed(main())
