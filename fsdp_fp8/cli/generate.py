"""The launcher's pipeline run: a diffusers pipeline root, its transformer sharded over the ranks.

FSDP is data-parallel: every rank holds a slice of the transformer and runs whole requests.
With ``--prompts FILE`` each rank takes every ``world``-th prompt (rank ``r``: prompts ``r``,
``r + world``, ...). Every forward all-gathers each layer's parameters from every rank, so
all ranks must run the same number of forwards: a rank whose share is short runs padding
requests (the first prompt, latents only, discarded) until every rank has run as many as
the busiest. Outputs are written by the rank that generated them, named per prompt
(``out.png`` -> ``out-000.png``, ``out-001.png``, ... with ``--prompts``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_fp8.format.hub import resolve_hub_path
from fsdp_fp8.format.step_policy import describe_trace
from fsdp_fp8.interop.cfg_parallel import request_slots
from fsdp_fp8.interop.pipeline import MODEL_INDEX, load_pipeline
from fsdp_fp8.load.residency import apply_residency
from fsdp_fp8.runtime.precision import routing_of

log = logging.getLogger("fsdp_fp8")

OUTPUT_SUFFIXES = (".png", ".mp4")


def is_pipeline_root(path) -> bool:
    """Whether ``path`` (a directory or a hub name in the local cache) holds ``model_index.json``."""
    try:
        return (resolve_hub_path(path) / MODEL_INDEX).is_file()
    except FileNotFoundError:  # not in the cache: load_model says so, in its own words
        return False


def read_prompts(args) -> list[str]:
    if not args.prompts:
        return [args.prompt]
    lines = [line.strip() for line in Path(args.prompts).read_text(encoding="utf-8").splitlines()]
    prompts = [line for line in lines if line]
    if not prompts:
        raise ValueError(f"--prompts {args.prompts}: no prompt in the file (one prompt per line)")
    return prompts


def check_output(output: str | None) -> None:
    """Refuse an output the launcher cannot write, before anything is loaded."""
    if output is None:
        return
    suffix = Path(output).suffix.lower()
    if suffix not in OUTPUT_SUFFIXES:
        raise ValueError(f"--output {output}: write .png (an image, or an animated PNG of the frames) or .mp4")
    if suffix == ".mp4":
        try:
            import imageio  # noqa: F401
            import imageio_ffmpeg  # noqa: F401
        except ImportError:
            raise ValueError(
                f"--output {output}: mp4 needs imageio and imageio-ffmpeg "
                "(pip install imageio imageio-ffmpeg); or write .png"
            ) from None
    if not Path(output).resolve().parent.is_dir():
        raise ValueError(f"--output {output}: directory {Path(output).resolve().parent} does not exist")


def output_path(output: str, index: int, many: bool) -> Path:
    path = Path(output)
    return path.with_name(f"{path.stem}-{index:03d}{path.suffix}") if many else path


def save_frames(frames: list, path: Path, fps: float) -> None:
    """Frames (PIL images) as one PNG, an animated PNG, or an mp4."""
    if path.suffix.lower() == ".mp4":
        from diffusers.utils import export_to_video

        export_to_video(frames, str(path), fps=int(round(fps)))
    elif len(frames) == 1:
        frames[0].save(path, format="PNG")
    else:
        frames[0].save(path, format="PNG", save_all=True, append_images=frames[1:], duration=int(1000 / fps), loop=0)


def _digest(latents: torch.Tensor) -> str:
    return hashlib.sha256(latents.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()).hexdigest()


def _size_kwargs(args) -> dict:
    return {
        k: v for k, v in (("num_frames", args.frames), ("height", args.height), ("width", args.width)) if v is not None
    }


def run_pipeline(args, path, device: torch.device, mesh=None) -> tuple[dict, list]:
    """Load the pipeline at ``path`` and generate; returns (report fields, per-rank load reports)."""
    prompts = read_prompts(args)
    check_output(args.output)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.disable_progress_bar()  # "Loading pipeline components..." on every rank
    t0 = time.perf_counter()
    cfg_parallel = getattr(args, "cfg_parallel", False)
    slot, slots, writes = request_slots(rank, world, cfg_parallel)  # --cfg-parallel: a pair per request
    pipe = load_pipeline(path, mesh, device=device, step_policy=args.step_policy, cfg_parallel=cfg_parallel)
    load_s = time.perf_counter() - t0
    residency = apply_residency(pipe.transformer, args.resident, budget_bytes=args.resident_budget, device=device)
    pipe.set_progress_bar_config(disable=True)
    routing = routing_of(pipe.transformer)
    loaded = pipe.fsdp_fp8
    if rank == 0:
        log.info(
            "loaded %s: %d FP8 linears; %d prompt(s) over %d rank(s), %d steps each",
            type(pipe).__name__,
            len(loaded.fp8_linears),
            len(prompts),
            world,
            args.steps,
        )
    results = []
    t1 = time.perf_counter()
    for round_ in range(math.ceil(len(prompts) / slots)):
        index = slot + round_ * slots
        real = index < len(prompts)
        final = {}

        def on_step(_pipe, i, _t, kwargs, real=real, index=index):
            final["latents"] = kwargs["latents"]
            if rank == 0 and real:
                label = routing.trace[-1]
                log.info("prompt %d  step %d/%d  %s", index, i + 1, args.steps, label)
            return {}

        start = len(routing.trace)
        out = pipe(
            prompts[index] if real else prompts[0],
            negative_prompt=args.negative_prompt,
            **_size_kwargs(args),
            fps=args.fps,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance,
            generator=torch.Generator().manual_seed(args.seed),
            callback_on_step_end=on_step,
            output_type="pil" if real and writes and args.output else "latent",
        )
        if not (real and writes):  # padding (it kept this rank in step with the others), or the uncond rank
            continue
        row = {
            "index": index,
            "prompt": prompts[index],
            "rank": rank,
            "precision_trace": describe_trace(routing.trace[start:]),
            "latent_shape": list(final["latents"].shape),
            "latent_sha256": _digest(final["latents"]),
        }
        if args.output:
            target = output_path(args.output, index, args.prompts is not None)
            save_frames(list(out.video), target, args.fps)
            row["output"] = str(target)
        results.append(row)
    sample_s = time.perf_counter() - t1
    gathered = [results]
    if dist.is_initialized():
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
    rows = sorted((r for part in gathered for r in part), key=lambda r: r["index"])
    first = rows[0]
    report = {
        "checkpoint": str(path),
        "pipeline": type(pipe).__name__,
        "fp8_linears": len(loaded.fp8_linears),
        "steps": args.steps,
        "cfg_parallel": cfg_parallel,
        "load_seconds": round(load_s, 3),
        "sample_seconds": round(sample_s, 3),
        "residency": residency.as_dict(),
        "step_policy": "checkpoint" if routing.policy is not None else "none",
        "precision_trace": first["precision_trace"],
        "latent_shape": first["latent_shape"],
        "latent_sha256": first["latent_sha256"],
        "outputs": rows,
    }
    return report, loaded
