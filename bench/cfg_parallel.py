"""CFG-parallel against the sequential loop: wall time per denoising step per rank, 2 gloo ranks
on CPU, the demo Cosmos 3 pipeline at a size where the transformer's compute dominates.

Both runs shard the transformer over the same 2 ranks (FSDP), so they differ only in what each
rank computes per step: both guidance passes (sequential) or one (CFG-parallel, after step 0,
which runs both and records the unconditional inputs). Steps 1.. are timed (median of the
per-step times of rank 0), one thread per rank; latents are compared too.

    python -m bench.cfg_parallel [--height 256 --width 384 --frames 17 --steps 6]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_fp8.runtime.shutdown import shutdown_distributed


def _rank(rank: int, world: int, store: str, args, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from fsdp_fp8 import load_pipeline

    out = {}
    for cfg in (False, True):
        pipe = load_pipeline(args.root, device=torch.device("cpu"), cfg_parallel=cfg)
        pipe.set_progress_bar_config(disable=True)
        stamps = []

        def on_step(_pipe, _i, _t, _kwargs, stamps=stamps):
            stamps.append(time.perf_counter())
            return {}

        dist.barrier()
        result = pipe(
            "a red fox",
            num_frames=args.frames,
            height=args.height,
            width=args.width,
            num_inference_steps=args.steps,
            guidance_scale=3.0,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
            callback_on_step_end=on_step,
        )
        steps = [b - a for a, b in zip(stamps, stamps[1:])]  # steps 1 .. n-1
        digest = hashlib.sha256(result.video.float().contiguous().numpy().tobytes()).hexdigest()
        out["cfg" if cfg else "sequential"] = (statistics.median(steps), digest)
    queue.put((rank, out))
    shutdown_distributed(0)  # not a finalizing exit: docs/shutdown.md


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--height", type=int, default=256)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--frames", type=int, default=17)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    from fsdp_fp8.generation.demo import demo_checkpoint

    args.root = str(demo_checkpoint())
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, 2, store, args, queue)) for r in range(2)]
        for proc in procs:
            proc.start()
        results = dict(queue.get(timeout=3600) for _ in procs)
        for proc in procs:
            proc.join(timeout=60)
    seq, cfg = results[0]["sequential"], results[0]["cfg"]
    print(f"{args.height}x{args.width}, {args.frames} frames, {args.steps} steps, 2 ranks, 1 thread each")
    print(f"sequential   {seq[0] * 1000:8.1f} ms/step")
    print(f"CFG-parallel {cfg[0] * 1000:8.1f} ms/step   ratio {cfg[0] / seq[0]:.2f} (target <= 0.6)")
    same = seq[1] == cfg[1] == results[1]["cfg"][1]
    print(f"latents identical: {same}   load average: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
