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

from fsdp_fp8.cli.outputs import check_output, output_path, read_prompts
from fsdp_fp8.cli.reports import PromptOutput, plural
from fsdp_fp8.collective import rank_and_world
from fsdp_fp8.compose.pipeline import load_pipeline, loaded_of
from fsdp_fp8.format.hub import resolve_hub_path
from fsdp_fp8.format.step_policy import describe_trace
from fsdp_fp8.interop.diffusers_pipeline import MODEL_INDEX
from fsdp_fp8.interop.vae_decode import decode_request, request_decode
from fsdp_fp8.runtime.parallel_layout import ParallelLayout
from fsdp_fp8.runtime.precision import routing_of
from fsdp_fp8.runtime.residency import apply_residency

log = logging.getLogger("fsdp_fp8")

__all__ = ["check_output", "is_pipeline_root", "output_path", "read_prompts", "run_pipeline", "save_frames"]


def is_pipeline_root(path) -> bool:
    """Whether ``path`` (a directory or a hub name in the local cache) holds ``model_index.json``."""
    try:
        return (resolve_hub_path(path) / MODEL_INDEX).is_file()
    except FileNotFoundError:  # not in the cache: load_model says so, in its own words
        return False


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


def run_pipeline(args, path, options) -> tuple[dict, object]:
    """Load the pipeline at ``path`` with ``options`` (a ``LoadOptions``) and generate every
    prompt; returns (the ``PipelineReport`` fields of this run, the ``LoadedModel``). The same
    fields on every rank."""
    prompts = read_prompts(args)
    check_output(args.output)
    rank, world = rank_and_world()
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.disable_progress_bar()  # "Loading pipeline components..." on every rank
    t0 = time.perf_counter()
    cfg_parallel = getattr(args, "cfg_parallel", False)
    sequence_parallel = getattr(args, "sequence_parallel", 1)
    # The ranks of one request: a CFG pair, a sequence group, or both (runtime.parallel_layout)
    layout = ParallelLayout(rank, world, cfg_parallel=cfg_parallel, sequence_parallel=sequence_parallel)
    slot, slots, writes = layout.slot, layout.slots, layout.writes
    pipe = load_pipeline(
        path,
        step_policy=args.step_policy,
        cfg_parallel=cfg_parallel,
        sequence_parallel=sequence_parallel,
        options=options,
    )
    load_s = time.perf_counter() - t0
    residency = apply_residency(
        pipe.transformer, args.resident, budget_bytes=args.resident_budget, device=options.device
    )
    pipe.set_progress_bar_config(disable=True)
    vae_tiling = getattr(args, "vae_tiling", "off")
    # off: the pipeline decodes on the writer, as before; else the request's ranks share the decode
    request = request_decode(layout) if vae_tiling != "off" else None
    routing = routing_of(pipe.transformer)
    loaded = loaded_of(pipe)
    if rank == 0:
        log.info(
            "loaded %s: %s; %s over %s, %s each",
            type(pipe).__name__,
            plural(len(loaded.fp8_linears), "FP8 linear"),
            plural(len(prompts), "prompt"),
            plural(world, "rank"),
            plural(args.steps, "step"),
        )
    t1 = time.perf_counter()
    decode = (vae_tiling, request)
    mine = [_generate(pipe, routing, args, prompts, i, rank, writes, decode) for i in _share(len(prompts), slot, slots)]
    sample_s = time.perf_counter() - t1
    gathered = [mine]
    if dist.is_initialized():
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
    rows = sorted((r for part in gathered for r in part if r is not None), key=lambda r: r.index)
    fields = dict(
        pipeline=type(pipe).__name__,
        steps=args.steps,
        cfg_parallel=cfg_parallel,
        parallelism=layout.describe(),
        load_seconds=round(load_s, 3),
        sample_seconds=round(sample_s, 3),
        residency=residency.as_dict(),
        step_policy="checkpoint" if routing.policy is not None else "none",
        precision_trace=rows[0].precision_trace,
        latent_shape=rows[0].latent_shape,
        latent_sha256=rows[0].latent_sha256,
        outputs=rows,
    )
    return fields, loaded


def _share(count: int, slot: int, slots: int) -> list[int]:
    """The prompt indices this rank's slot runs, one per round; an index past ``count`` is padding."""
    return [slot + round_ * slots for round_ in range(math.ceil(count / slots))]


def _generate(pipe, routing, args, prompts: list[str], index, rank, writes, decode) -> PromptOutput | None:
    """One request: prompt ``index``, or (past the last prompt) padding that only keeps this rank
    in step with the others' all-gathers (None). ``writes`` is False on a CFG pair's uncond rank:
    it holds the same latents as its partner, which reports and saves them (None). ``decode``:
    (``--vae-tiling``, this rank's ``RequestDecode`` or None)."""
    real = index < len(prompts)
    mode, request = decode
    ours = mode != "off" and real and bool(args.output)  # the request's ranks decode (interop.vae_decode)
    final = {}

    def on_step(_pipe, i, _t, kwargs):
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
        output_type="pil" if real and writes and args.output and not ours else "latent",
    )
    frames, how = decode_request(pipe, out.video, request, mode) if ours else (out.video, None)
    if not (real and writes):
        return None
    row = PromptOutput(
        index=index,
        prompt=prompts[index],
        rank=rank,
        precision_trace=describe_trace(routing.trace[start:]),
        latent_shape=list(final["latents"].shape),
        latent_sha256=_digest(final["latents"]),
        vae_decode=how,
    )
    if args.output:
        target = output_path(args.output, index, args.prompts is not None)
        save_frames(list(frames), target, args.fps)
        row.output = str(target)
    return row
