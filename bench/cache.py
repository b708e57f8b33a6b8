"""The step cache (``--cache seacache``) against the uncached run, in one run: the transformer's
decoder stacks run per video and the wall time of the denoising loop (the ratio cached / uncached),
and how far the cached video is from the uncached one (PSNR of the decoded frames; LPIPS where the
``lpips`` package is installed). The demo Cosmos 3 pipeline has random weights: the difference is
a check of the mechanism, not a claim about quality.

1 rank in this process, or CFG 2 x Ulysses 2 on 4 gloo ranks (``--layout cfg-ulysses``), one
thread per rank; both runs load the same pipeline the same way, warm it with a one-step call, and
differ only in ``cache``; the uncached run goes first.

    python -m bench.cache [--steps 35 --frames 9 --height 64 --width 48 --threshold 0.25]
    python -m bench.cache --layout cfg-ulysses
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.distributed as dist

from bench import harness


def _video(root: str, args, cache, layout: dict) -> dict:
    from fsdp_fp8 import load_pipeline
    from fsdp_fp8.testing.collective_counts import pipeline_state

    pipe = load_pipeline(root, device=torch.device("cpu"), cache=cache, **layout)
    pipe.set_progress_bar_config(disable=True)
    call = dict(num_frames=args.frames, height=args.height, width=args.width, guidance_scale=3.0)
    pipe("warm-up", **call, num_inference_steps=1, output_type="latent")  # first-call costs out of the timing
    state = pipeline_state(pipe.transformer)
    start = len(state.cache.trace) if state.cache is not None else 0
    stacks = []
    pipe.transformer.layers[0].register_forward_pre_hook(lambda *_: stacks.append(1))
    stamps = harness.StepStamps()
    if dist.is_initialized():
        dist.barrier()
    started = time.perf_counter()
    out = pipe(
        "a red fox jumps over a sleeping dog",
        **call,
        num_inference_steps=args.steps,
        generator=torch.Generator().manual_seed(0),
        output_type="np",  # the pipeline's own decode, after the last step's stamp
        callback_on_step_end=stamps,
    )
    return {
        "seconds": stamps.since(started),  # the denoising loop alone
        "stacks": len(stacks),
        "frames": torch.from_numpy(out.video).float(),  # (B, T, H, W, C) in [0, 1]
        "decisions": state.cache.summary(start) if state.cache is not None else "off",
    }


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of frames in [0, 1]."""
    mse = float(((a - b) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def _lpips(a: torch.Tensor, b: torch.Tensor) -> float | None:
    try:
        import lpips
    except ImportError:
        return None
    metric = lpips.LPIPS(net="alex", verbose=False)
    frames = lambda x: x[0].permute(0, 3, 1, 2) * 2 - 1  # noqa: E731 - (T, C, H, W) in [-1, 1]
    return float(metric(frames(a), frames(b)).mean())


def measure(root: str, args, layout: dict) -> dict:
    """Both runs on this rank; the ratios and the difference."""
    plain = _video(root, args, None, layout)
    cached = _video(root, args, f"seacache:{args.threshold:g}", layout)
    return {
        "passes": (cached["stacks"], plain["stacks"]),
        "wall": (cached["seconds"], plain["seconds"]),
        "decisions": cached["decisions"],
        "psnr_db": _psnr(cached["frames"], plain["frames"]),
        "lpips": _lpips(cached["frames"], plain["frames"]),
    }


def _rank(rank: int, world: int, root: str, args) -> dict:
    return measure(root, args, {"cfg_parallel": True, "ulysses": 2})


def report(result: dict, args, layout: str) -> str:
    (cached_passes, plain_passes), (cached_s, plain_s) = result["passes"], result["wall"]
    lpips = "not installed" if result["lpips"] is None else f"{result['lpips']:.3f}"
    return "\n".join(
        [
            f"step cache seacache:{args.threshold:g}, {layout}, {args.steps} steps, "
            f"{args.frames} x {args.height} x {args.width} (demo, random weights: a mechanism check)",
            f"decisions        {result['decisions']}",
            f"decoder stacks   {cached_passes} of {plain_passes} (ratio {cached_passes / plain_passes:.2f}, rank 0)",
            f"denoising wall   {cached_s:.2f} s vs {plain_s:.2f} s (ratio {cached_s / plain_s:.2f})",
            f"frames vs uncached: PSNR {result['psnr_db']:.1f} dB, LPIPS {lpips}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=35)
    p.add_argument("--frames", type=int, default=9)
    p.add_argument("--height", type=int, default=64)
    p.add_argument("--width", type=int, default=48)
    p.add_argument("--threshold", type=float, default=0.25)
    p.add_argument("--layout", choices=("one-rank", "cfg-ulysses"), default="one-rank")
    args = p.parse_args(argv)
    from fsdp_fp8.generation.demo import demo_checkpoint

    root = str(demo_checkpoint())
    if args.layout == "one-rank":
        torch.set_num_threads(1)
        result = measure(root, args, {})
    else:
        result = harness.spawn_ranks(_rank, 4, root, args)[0]
    print(report(result, args, "1 rank" if args.layout == "one-rank" else "CFG 2 x Ulysses 2 on 4 gloo ranks"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
