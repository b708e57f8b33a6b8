"""What the launcher loads, checked before torch is imported: the checkpoint a path names and,
for a diffusers pipeline, the sizes its VAE can make.

A path names a checkpoint when it is a directory holding one (safetensors files or an index), a
diffusers pipeline root (``model_index.json`` beside a ``transformer/`` holding one) or a hub name
whose snapshot is in the local cache (``fsdp_fp8.format.hub``). Anything else (missing, a file,
unreadable, a directory holding no checkpoint, a hub name not in the cache) is a usage problem
naming the option and the path, found in the time of any other usage error: before torch and
before any process group (docs/usage.md). What is inside the files is checked by the load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from fsdp_fp8.errors import CheckpointPathError
from fsdp_fp8.format.files import find_layout, resolve_directory
from fsdp_fp8.format.hub import resolve_hub_path
from fsdp_fp8.format.pipeline_config import SPATIAL, TEMPORAL, PipelineFactors, read_pipeline_factors
from fsdp_fp8.generation.actions import action_problems
from fsdp_fp8.generation.declare import bounds
from fsdp_fp8.generation.values import VALUE_CLASSES
from fsdp_fp8.interop.diffusers_pipeline import (  # imports no torch
    MODEL_INDEX,
    distilled_problems,
    distilled_steps,
    guardrail_problem,
    index_path,
    is_pipeline_index,
    missing_components,
)
from fsdp_fp8.runtime.parallel_layout import AttentionHeads, head_problems  # nor this


def checkpoint_problems(option: str, path: str) -> tuple[Path | None, list[str]]:
    """(the directory ``path`` names, a hub name resolved; why it holds no checkpoint to load)."""
    try:
        root = resolve_hub_path(path)
        weights = resolve_directory(root)
    except CheckpointPathError as exc:
        return None, [f"{option}: {p}" for p in exc.problems]
    if not os.access(weights, os.R_OK | os.X_OK):
        return None, [f"{option}: {weights} cannot be read (permission denied for this user)"]
    problems: list[str] = []
    try:
        find_layout(weights, problems)
    except OSError as exc:  # a directory that vanished or turned unreadable meanwhile
        problems.append(f"{weights}: cannot be read: {exc.strerror or exc}")
    return root, [f"{option}: {p}" for p in problems]


def demo_factors() -> PipelineFactors:
    """The embedded demo's factors (its VAE and transformer configs, known before it is built)."""
    from fsdp_fp8.generation.demo import TRANSFORMER_CONFIG, VAE_CONFIG

    return PipelineFactors(
        VAE_CONFIG["scale_factor_spatial"],
        VAE_CONFIG["scale_factor_temporal"],
        TRANSFORMER_CONFIG["latent_patch_size"],
        "the demo's VAE",
        transformer=TRANSFORMER_CONFIG,
        transformer_config="the demo's transformer config",
    )


def pipeline_problems(values, root: Path | None) -> list[str]:
    """What the pipeline at ``root`` (None: the demo) cannot do of what ``values`` ask, from its
    configs read once: ``--height`` / ``--width`` / ``--frames`` it cannot make, factors no size
    can be divided by, and a ``--ulysses`` degree its attention heads cannot take.
    For a model that is no pipeline: only ``--ulysses`` (its run ignores the sizes, with
    a warning; only a pipeline's transformer is split)."""
    degree = getattr(values, "ulysses", 1)
    if root is not None and not is_pipeline_index(root):
        problems = [f"--sound generates with a diffusers pipeline; {root} has no {MODEL_INDEX}"] if values.sound else []
        if degree == 1:
            return problems
        return problems + [
            f"--ulysses {degree} splits a diffusers pipeline's transformer; {root} has no {MODEL_INDEX} "
            "(run it without --ulysses)"
        ]
    problems: list[str] = []
    if root is None:
        factors = demo_factors()
    else:
        factors = read_pipeline_factors(root, problems)
        problems = [f"--checkpoint: {p}" for p in problems]
    problems += _size_problems(values, factors)
    if degree != 1:  # the degree against the world: options.value_problems
        heads = AttentionHeads.of(dict(factors.transformer), str(factors.transformer_config))
        problems += [f"--ulysses {degree}: {p}" for p in head_problems(heads, degree)]
    problems += _condition_frame_problems(values, factors, demo=root is None)
    index = _model_index(root) if root is not None else {}
    if root is not None:
        problems += [f"--checkpoint: {p}" for p in missing_components(root, index)]
    if values.sound:
        problems += _sound_problems(root, index, factors)
    problems += action_problems(values, dict(factors.transformer or {}) or None, str(factors.transformer_config))
    if root is not None and (schedule := distilled_steps(index)) is not None:
        problems += _distilled_problems(values, root, schedule)
    if getattr(values, "safety_check", "on") == "on" and (guardrail := guardrail_problem(index)):
        problems.append(f"--checkpoint {root}: {guardrail}; or run without it: --safety-check off")
    return problems


def _distilled_problems(values, root: Path, schedule: int) -> list[str]:
    """What a distilled root (its fixed ``schedule``, guidance 1.0) refuses, before the load:
    ``--steps`` / ``--guidance`` given off it (diffusers' own reasons), ``--cfg-parallel`` (no
    CFG pair without guidance), a negative prompt (no unconditional pass). ``values`` without
    ``given`` (a served request, the Python API's values) are checked as they are: the engine would
    refuse them at their round."""
    given = getattr(values, "given", None)  # the launcher's; other front ends' values are all given
    steps = values.steps if given is None or "steps" in given else schedule
    guidance = values.guidance if given is None or "guidance" in given else 1.0
    where = f"--steps {steps} / --guidance {guidance} on {root}"
    problems = distilled_problems(where, steps, guidance, schedule)
    if getattr(values, "cfg_parallel", False):
        problems.append(
            f"--cfg-parallel: {root} is a distilled checkpoint: guidance 1.0, one transformer pass per step, "
            "so no CFG pair to split; use --ulysses N or --replicas R"
        )
    if getattr(values, "negative_prompt", None) is not None:
        problems.append(f"--negative-prompt: {root} is a distilled checkpoint; it takes no negative prompt")
    return problems


def _model_index(root: Path) -> dict:
    """The pipeline's index as read (``{}`` when unreadable: the load says what is wrong with it)."""
    try:
        index = json.loads(index_path(root).read_text())
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def _sound_problems(root: Path | None, index: dict, factors: PipelineFactors) -> list[str]:
    """Why the pipeline at ``root`` (None: the demo, which can) cannot generate sound: no sound
    tokenizer in its ``model_index.json`` (``index``), or a transformer without ``sound_gen``."""
    problems = []
    if root is not None:
        entry = index.get("sound_tokenizer")
        if not (isinstance(entry, list) and len(entry) == 2 and all(entry)):
            problems.append(
                f"--sound: {root / MODEL_INDEX} names no `sound_tokenizer` ({entry!r}); this pipeline has no sound"
            )
    if factors.transformer.get("sound_gen") is not True:
        problems.append(f"--sound: {factors.transformer_config} has no `sound_gen`: its transformer makes no sound")
    return problems


def _size_problems(values, factors: PipelineFactors) -> list[str]:
    """``--height`` / ``--width`` / ``--frames`` that ``factors`` do not divide."""
    problems: list[str] = []

    def source(key: str, step: int) -> str:
        return f"`{key}` {step} in {factors.vae_config}"

    for name in ("height", "width"):
        value, step = _in_bounds(values, name), factors.spatial
        if value is not None and step and value % step:
            below = value - value % step
            nearest = f"{below} or {below + step}" if below else f"{step}"
            problems.append(f"--{name} {value} is not a multiple of {step} ({source(SPATIAL, step)}): use {nearest}")
    frames, step = _in_bounds(values, "frames"), factors.temporal
    if frames is not None and step and (frames - 1) % step:
        below = frames - (frames - 1) % step
        problems.append(
            f"--frames {frames} is not 1 + a multiple of {step} ({source(TEMPORAL, step)}: the VAE makes "
            f"1, {1 + step}, {1 + 2 * step}, ... frames): use {below} or {below + step}"
        )
    return problems


def _condition_frame_problems(values, factors: PipelineFactors, demo: bool) -> list[str]:
    """``--condition-frames`` against the latent timeline of the frames generated: ``1 + (frames -
    1) // scale_factor_temporal`` latent frames (the pipeline's own count). Unchecked when the frame
    count is the pipeline's own default (not known here) or its VAE does not say its factor."""
    indexes = getattr(values, "condition_frames", None)
    frames, step = _in_bounds(values, "frames"), factors.temporal
    if frames is None and demo:  # the demo's video: generation.loading.demo_sizes
        from fsdp_fp8.generation.demo import DEMO_CONDITIONED_FRAMES

        frames = DEMO_CONDITIONED_FRAMES if (values.image or values.video or values.sound) else None
    if not indexes or frames is None or frames == 1 or not step:  # frames 1: refused on its own
        return []
    latent = 1 + (frames - 1) // step
    outside = [i for i in indexes if isinstance(i, int) and i >= latent]
    if not outside:
        return []
    given = f"--frames {frames}" if getattr(values, "frames", None) is not None else f"the demo's {frames} frames"
    named = f"latent frame {outside[0]} is" if len(outside) == 1 else f"latent frames {outside} are"
    return [
        f"--condition-frames {','.join(str(i) for i in indexes)}: {named} outside the latent timeline of "
        f"{given}: {latent} latent frames, 0..{latent - 1} (1 + ({frames} - 1) // {step}, `{TEMPORAL}` {step} "
        f"in {factors.vae_config})"
    ]


def _in_bounds(values, name: str) -> int | None:
    """The option's value when it is inside its bounds (outside, that is the problem reported)."""
    value = getattr(values, name, None)
    return value if value is not None and bounds(*VALUE_CLASSES)[name].problem(name, value) is None else None
