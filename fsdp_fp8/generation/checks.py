"""The option checks: every value before anything is loaded (the launcher's command line and the
server's requests alike), and which options a kind of run uses (an option the run would ignore is
said aloud, not dropped silently). The bounds are the declarations' (``generation.values``)."""

from __future__ import annotations

import os

from fsdp_fp8.generation.declare import bound_problems, uses
from fsdp_fp8.generation.media import image_problems, video_problems
from fsdp_fp8.generation.prompts import prompt_problem
from fsdp_fp8.generation.values import CAUSAL_LM, COSMOS3, DIFFUSERS, MOT, PIPELINE, VALUE_CLASSES
from fsdp_fp8.runtime.parallel_layout import layout_problems

# kind -> the options (argparse dests) its run reads, made from the declarations
USES = {kind: uses(kind, *VALUE_CLASSES) for kind in (PIPELINE, COSMOS3, MOT, CAUSAL_LM, DIFFUSERS, "transformers")}


def value_problems(values) -> list[str]:
    """Every option value that cannot work, found before loading, the same on every rank (sorted).
    ``values``: anything with the options as attributes (a ``Namespace``, the frozen values)."""
    problems = bound_problems(values, *VALUE_CLASSES)
    problems += _layout_problems(values)
    for name in ("prompt", "negative_prompt"):
        text = getattr(values, name, None)
        if text is not None and (problem := prompt_problem(text)):
            problems.append(f"--{name.replace('_', '-')} {problem}")
    ids = getattr(values, "prompt_ids", None)
    if ids is not None and (not ids or min(ids) < 0):
        problems.append(f"--prompt-ids must list token ids >= 0, got {ids}")
    return sorted(problems)


def _layout_problems(values) -> list[str]:
    """The layout's one check (``runtime.parallel_layout``, no torch), its weight dims and its
    work dims each named by the options that asked for them."""
    world = getattr(values, "nproc_per_node", None) or _world_size()
    replicas = getattr(values, "replicas", 1)
    cfg, ulysses = getattr(values, "cfg_parallel", False), getattr(values, "ulysses", 1)
    problems = []
    if replicas is not None and replicas != 1:
        problems += [f"--{p}" for p in layout_problems(world, False, 1, replicas)]
    if cfg or ulysses != 1:
        given = " ".join((["--cfg-parallel"] if cfg else []) + ([f"--ulysses {ulysses}"] if ulysses != 1 else []))
        problems += [f"{given}: {p}" for p in layout_problems(world, cfg, ulysses)]
    return problems


def conditioning_problems(values, prompts: list) -> list[str]:
    """The conditioning inputs, as this node's files have them, and their combinations: an image
    or a video per request (the pipeline takes one), condition options only with a video, and a
    video to generate (``--frames 1`` makes an image: the pipeline ignores the conditioning)."""
    problems = image_problems("--image", values.image) if values.image else []
    problems += video_problems("--video", values.video) if values.video else []
    requests = [("--image / --video", values.image, values.video)]
    for p in prompts:
        where = f"--prompts {values.prompts} line {p.line}"
        problems += image_problems(f'{where} "image"', p.image) if p.image else []
        problems += video_problems(f'{where} "video"', p.video) if p.video else []
        requests.append((where, p.image or values.image, p.video or values.video))
    for where, image, video in requests:
        if image and video:
            problems.append(f"{where}: an image and a video; the pipeline takes one (image- or video-to-video)")
    conditioned = any(image or video for _, image, video in requests)
    if (values.condition_frames is not None or values.condition_keep) and not any(v for _, _, v in requests):
        problems.append("--condition-frames / --condition-keep choose a --video's frames; give a --video too")
    if conditioned and values.frames == 1:
        problems.append("--frames 1 makes an image, and the pipeline ignores --image / --video for it; use 5 or more")
    elif (
        conditioned
        and values.frames is None
        and values.checkpoint is None
        and not (values.image or values.video or values.sound)
    ):
        problems.append(
            f"--prompts {values.prompts} conditions requests on images or videos, and the demo makes one "
            "image unless told otherwise: pass --frames 5 (or more)"
        )
    if values.sound and values.output and not values.output.lower().endswith(".mp4"):
        problems.append(f"--sound is muxed into a video file; --output {values.output} is no .mp4")
    return problems


def _world_size() -> int:
    """The world size torchrun announces (1 without it): known before any process group."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def ignored_options(values, given: set[str]) -> list[str]:
    """Options given that this run of a pipeline never reaches, each a warning (the run goes on):
    ``--vae-tiling`` without ``--output`` (only an output's frames are decoded; a run without one
    keeps latents, and a sound track, only). ``values``: the options as attributes."""
    notes = []
    if "vae_tiling" in given and not getattr(values, "output", None):
        notes.append(
            f"--vae-tiling {values.vae_tiling} chooses how an --output's frames are decoded; without --output "
            "nothing is decoded (the latents are digested as they are), so it is ignored"
        )
    return notes


def unused_options(given: set[str], kind: str) -> list[str]:
    """The given options a run of ``kind`` ignores, as ``--option`` names (sorted)."""
    used = USES.get(kind)
    if used is None:
        return []
    return sorted(f"--{name.replace('_', '-')}" for name in given - used)
