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

import torch
import torch.distributed as dist

from bench import harness


def _rank(rank: int, world: int, args) -> dict:
    from fsdp_fp8 import load_pipeline

    out = {}
    for cfg in (False, True):
        pipe = load_pipeline(args.root, device=torch.device("cpu"), cfg_parallel=cfg)
        pipe.set_progress_bar_config(disable=True)
        stamps = harness.StepStamps()
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
            callback_on_step_end=stamps,
        )
        digest = hashlib.sha256(result.video.float().contiguous().numpy().tobytes()).hexdigest()
        out["cfg" if cfg else "sequential"] = (statistics.median(stamps.steps()), digest)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--height", type=int, default=256)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--frames", type=int, default=17)
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    from fsdp_fp8.generation.demo import demo_checkpoint

    args.root = str(demo_checkpoint())
    results = harness.spawn_ranks(_rank, 2, args)
    seq, cfg = results[0]["sequential"], results[0]["cfg"]
    print(f"{args.height}x{args.width}, {args.frames} frames, {args.steps} steps, 2 ranks, 1 thread each")
    print(f"sequential   {seq[0] * 1000:8.1f} ms/step")
    print(f"CFG-parallel {cfg[0] * 1000:8.1f} ms/step   ratio {cfg[0] / seq[0]:.2f} (target <= 0.6)")
    same = seq[1] == cfg[1] == results[1]["cfg"][1]
    print(f"latents identical: {same}   load average: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
