"""Sequence parallelism against one rank: wall time per denoising step, on CPU, the demo Cosmos 3
pipeline at a size where attention dominates the step.

The one-rank run is a world of 1 (the whole step on one process); the other is 2 gloo ranks with
``sequence_parallel=2`` (each rank half of the generation tokens' linears and half of the heads'
attention, the FP8 weights sharded over both). One thread per rank, so on a 2-core machine each
rank has a core of its own, as each rank has a GPU. Steps 1.. are timed (median of rank 0's
per-step times, after a warm-up step); the runs alternate ``--rounds`` times and the ratio of each
pair is printed with the median; the final latents are compared too.

    python bench/sequence_parallel.py [--height 288 --width 288 --frames 9 --steps 4 --rounds 3]
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


def _rank(rank: int, world: int, store: str, args, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from fsdp_fp8 import load_pipeline

    pipe = load_pipeline(args.root, device=torch.device("cpu"), sequence_parallel=world)
    pipe.set_progress_bar_config(disable=True)
    stamps = []

    def on_step(_pipe, _i, _t, _kwargs):
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
    _, _, frames, height, width = result.video.shape
    tokens = frames * (height // 2) * (width // 2)  # the demo transformer's patch is 2
    queue.put((rank, statistics.median(steps), digest, tokens))
    dist.destroy_process_group()


def run(world: int, args) -> tuple[float, str, int]:
    """(rank 0's median seconds per step, the latent's digest, the generation tokens) of one run
    on ``world`` ranks."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, world, store, args, queue)) for r in range(world)]
        for proc in procs:
            proc.start()
        results = sorted(queue.get(timeout=3600) for _ in procs)
        for proc in procs:
            proc.join(timeout=60)
    assert len({digest for _, _, digest, _ in results}) == 1, results
    return results[0][1:]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--height", type=int, default=288)
    p.add_argument("--width", type=int, default=288)
    p.add_argument("--frames", type=int, default=9)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from fsdp_fp8.cli.demo import demo_checkpoint

    args.root = str(demo_checkpoint())
    pairs, digests, loads = [], set(), []
    for _ in range(args.rounds):
        one, d1, tokens = run(1, args)
        two, d2, _ = run(2, args)
        pairs.append((one, two))
        digests |= {d1, d2}
        loads.append(os.getloadavg()[0])
    print(f"{args.height}x{args.width}, {args.frames} frames ({tokens} generation tokens), {args.steps} steps")
    for one, two in pairs:
        print(f"  1 rank {one * 1000:8.1f} ms/step   SP 2 {two * 1000:8.1f} ms/step   ratio {two / one:.2f}")
    ratio = statistics.median(two / one for one, two in pairs)
    print(f"median ratio {ratio:.2f} (target <= 0.6); latents identical: {len(digests) == 1}")
    print(f"load average after each round: {', '.join(f'{x:.2f}' for x in loads)}")


if __name__ == "__main__":
    main()
