"""The launcher's pipeline run: a diffusers pipeline root, its transformer sharded over the ranks.

FSDP is data-parallel: every rank holds a slice of the transformer and runs whole requests; the
ranks of one request are one group of the layout's ``request`` dim (one rank, or a CFG pair and
Ulysses groups: ``runtime.parallel_layout``). With ``--prompts FILE`` request group ``g`` of ``G``
takes prompts ``g``, ``g + G``, ... (``G`` is the world size without CFG-parallel or Ulysses).
Every forward all-gathers each layer's parameters from every rank, so all ranks must run the
same number of forwards: a group whose share is short runs padding requests (the first prompt,
latents only, discarded) until every group has run as many as the busiest. Outputs are written
by the first rank of the group that generated them, named per prompt (``out.png`` ->
``out-000.png``, ``out-001.png``, ... with ``--prompts``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_fp8.cli.media import load_conditioning_image, load_conditioning_video
from fsdp_fp8.cli.outputs import check_output, output_path, read_prompts
from fsdp_fp8.cli.reports import PromptOutput, plural
from fsdp_fp8.cli.request import GenerationRequest, Job, Prompt
from fsdp_fp8.collective import rank_and_world
from fsdp_fp8.compose.pipeline import load_pipeline, loaded_of, pipeline_name
from fsdp_fp8.errors import ArgumentError
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


def run_pipeline(job: Job, path, options, mesh=None) -> tuple[dict, object]:
    """Load the pipeline at ``path`` with ``options`` (a ``LoadOptions``) over ``mesh`` (the
    launcher's ``ParallelMesh``; None: one process) and generate every prompt of ``job``; returns
    (the ``PipelineReport`` fields of this run, the ``LoadedModel``). The same fields on every rank."""
    request, settings = job.request, job.settings
    prompts = [_with_command_line(p, request) for p in read_prompts(request.prompts, request.prompt)]
    check_output(request.output, sound=request.sound)
    if request.frames == 1 and any(p.image or p.video for p in prompts):
        raise ArgumentError("a request conditioned on an image or a video makes a video; pass --frames 5 or more")
    rank, world = rank_and_world()
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.disable_progress_bar()  # "Loading pipeline components..." on every rank
    t0 = time.perf_counter()
    # The ranks of one request: a CFG pair, a Ulysses group, or both (runtime.parallel_layout)
    layout = mesh.layout if mesh is not None else ParallelLayout(world, settings.cfg_parallel, settings.ulysses)
    pipe = _load(job, path, options, mesh, layout)
    load_s = time.perf_counter() - t0
    residency = apply_residency(
        pipe.transformer, settings.resident, budget_bytes=settings.resident_budget, device=options.device
    )
    pipe.set_progress_bar_config(disable=True)
    # off: the pipeline decodes on the writer, as before; else the request's ranks share the decode
    decoder = request_decode(mesh) if settings.vae_tiling != "off" else None
    routing = routing_of(pipe.transformer)
    loaded = loaded_of(pipe)
    if rank == 0:
        log.info(
            "loaded %s: %s; %s over %s, %s each",
            pipeline_name(pipe),
            plural(len(loaded.fp8_linears), "FP8 linear"),
            plural(len(prompts), "prompt"),
            plural(world, "rank"),
            plural(request.steps, "step"),
        )
    t1 = time.perf_counter()
    decode = (settings.vae_tiling, decoder)
    mine = [
        _generate(pipe, routing, request, prompts, index, layout, rank, decode)
        for index in _share(len(prompts), layout, rank)
    ]
    sample_s = time.perf_counter() - t1
    gathered = [mine]
    if dist.is_initialized():
        gathered = [None] * layout.world
        dist.all_gather_object(gathered, mine)
    rows = sorted((r for part in gathered for r in part if r is not None), key=lambda r: r.index)
    fields = dict(
        pipeline=pipeline_name(pipe),
        steps=request.steps,
        cfg_parallel=layout.cfg_parallel,
        parallelism=layout.describe(),
        load_seconds=round(load_s, 3),
        sample_seconds=round(sample_s, 3),
        residency=residency.as_dict(),
        step_policy="checkpoint" if routing.policy is not None else "none",
        precision_trace=rows[0].precision_trace,
        latent_shape=rows[0].latent_shape,
        latent_sha256=rows[0].latent_sha256,
        outputs=rows,
        mode=" + ".join(sorted({r.mode for r in rows})),
    )
    return fields, loaded


def _load(job: Job, path, options, mesh, layout: ParallelLayout):
    """``load_pipeline`` as the job's settings ask: over the launcher's mesh (or, in one process,
    the layout's degrees), the attention backend, the guardrail on or off."""
    settings = job.settings
    work = {} if mesh is not None else {"cfg_parallel": layout.cfg_parallel, "ulysses": layout.ulysses}
    return load_pipeline(
        path,
        mesh,
        step_policy=job.request.step_policy,
        # diffusers' own default (native) unless the option was given: its setter warns of an
        # experimental feature, which a default run has not asked for
        attention_backend=settings.attention_backend if "attention_backend" in job.given else None,
        options=options,
        **work,
        **({"enable_safety_checker": False, "safety_checker": None} if settings.safety_check == "off" else {}),
    )


def _with_command_line(prompt: Prompt, request: GenerationRequest) -> Prompt:
    """A request's own fields, the command line's where it gives none."""
    return dataclasses.replace(
        prompt,
        negative_prompt=request.negative_prompt if prompt.negative_prompt is None else prompt.negative_prompt,
        image=prompt.image or request.image,
        video=prompt.video or request.video,
        seed=request.seed if prompt.seed is None else prompt.seed,
    )


def _conditioning(prompt: Prompt, request: GenerationRequest) -> dict:
    """The pipeline's conditioning keywords for ``prompt``, its image or video read by diffusers."""
    if prompt.image:
        return {"image": load_conditioning_image(prompt.image)}
    if not prompt.video:
        return {}
    kwargs = {"video": load_conditioning_video(prompt.video)}
    if request.condition_frames is not None:
        kwargs["condition_frame_indexes_vision"] = list(request.condition_frames)
    if request.condition_keep is not None:
        kwargs["condition_video_keep"] = request.condition_keep
    return kwargs


def _share(count: int, layout: ParallelLayout, rank: int) -> list[int]:
    """The prompt indices this rank's request group runs, one per round; an index past ``count`` is padding."""
    group, groups = layout.coordinates(rank).request, layout.requests
    return [group + round_ * groups for round_ in range(math.ceil(count / groups))]


def _generate(
    pipe, routing, request: GenerationRequest, prompts: list[Prompt], index: int, layout, rank: int, decode
) -> PromptOutput | None:
    """One request: prompt ``index``, or (past the last prompt) padding that only keeps this rank
    in step with the others' all-gathers (None). ``writes`` is False on every rank of a request
    group but its first: they hold the same latents as it, which reports and saves them (None).
    ``decode``: (``--vae-tiling``, this rank's ``RequestDecode`` or None)."""
    real = index < len(prompts)
    mode, decoder = decode
    # the request's ranks decode (interop.vae_decode); a video with sound keeps the pipeline's own
    # decode, which returns the track with the frames
    ours = mode != "off" and real and bool(request.output) and not request.sound
    final = {}
    writes = layout.writes(rank)

    def on_step(_pipe, i, _t, kwargs):
        final["latents"] = kwargs["latents"]
        if rank == 0 and real:
            label = routing.trace[-1]
            log.info("prompt %d  step %d/%d  %s", index, i + 1, request.steps, label)
        return {}

    start = len(routing.trace)
    prompt = prompts[index] if real else prompts[0]
    out = pipe(
        prompt.text,
        negative_prompt=prompt.negative_prompt,
        **_conditioning(prompt, request),
        **request.sizes(),
        fps=request.fps,
        enable_sound=request.sound,
        num_inference_steps=request.steps,
        guidance_scale=request.guidance,
        generator=torch.Generator().manual_seed(prompt.seed),
        callback_on_step_end=on_step,
        output_type="pil" if real and writes and request.output and not ours else "latent",
    )
    frames, how = decode_request(pipe, out.video, decoder, mode) if ours else (out.video, None)
    if not (real and writes):
        return None
    row = PromptOutput(
        index=index,
        prompt=prompt.text,
        rank=rank,
        precision_trace=describe_trace(routing.trace[start:]),
        latent_shape=list(final["latents"].shape),
        latent_sha256=_digest(final["latents"]),
        mode=prompt.mode(request.frames, request.sound),
        sound_sha256=_digest(out.sound) if out.sound is not None else None,
        vae_decode=how,
    )
    if request.output:
        target = output_path(request.output, index, request.prompts is not None)
        if out.sound is None:
            save_frames(list(frames), target, request.fps)
        else:  # diffusers' own muxer (PyAV)
            from diffusers.utils.export_utils import encode_video

            rate = pipe.sound_tokenizer.config.sampling_rate
            encode_video(list(out.video), int(round(request.fps)), str(target), out.sound.float().cpu(), rate)
        row.output = str(target)
    return row
