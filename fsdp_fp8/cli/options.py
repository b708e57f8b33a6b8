"""The launcher's option checks: every value before anything is loaded, and which options the
model kind uses (an option the run would ignore is said aloud, not dropped silently)."""

from __future__ import annotations

import argparse
import os

from fsdp_fp8.cli.outputs import prompt_problem, writable_file
from fsdp_fp8.format.timeouts import timeout_problems
from fsdp_fp8.runtime.parallel_layout import layout_problems

# kind -> the options (argparse dests) its run reads; "pipeline" is a diffusers pipeline root,
# "cosmos3" a Cosmos 3 denoiser alone, "diffusers" any other diffusers model (one forward).
DIFFUSION = {"steps", "seed", "prompt", "guidance", "step_policy"}
USES = {
    "mot": DIFFUSION | {"latent_tokens"},
    "cosmos3": DIFFUSION | {"negative_prompt"},
    "pipeline": DIFFUSION
    | {"prompts", "negative_prompt", "output", "frames", "height", "width", "fps", "cfg_parallel", "ulysses"}
    | {"image", "video", "condition_frames", "condition_keep", "attention_backend", "sound", "safety_check"}
    | {"vae_tiling"},
    "causal_lm": {"prompt", "prompt_ids", "new_tokens"},
    "diffusers": {"seed"},
    "transformers": set(),
}
# Options every kind takes (where to load from, how to run and report), or that other checks own.
EVERY_KIND = {
    "checkpoint",
    "report",
    "timeout",
    "replicas",
    "quantize",
    "include",
    "exclude",
    "resident",
    "resident_budget",
    "nproc_per_node",
    "overwrite",
}
# Inclusive bounds, checked before the load: past them a run would allocate without limit
# (--steps 10**15 asks for petabytes after the model is loaded) or a value means nothing.
BOUNDS = {
    "steps": (1, 10_000),
    "frames": (1, 1024),
    "height": (1, 16_384),
    "width": (1, 16_384),
    "latent_tokens": (1, 1_000_000),
    "new_tokens": (1, 100_000),
    "nproc_per_node": (1, 1024),
}
MAX_FPS = 1000.0


def given_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> set[str]:
    """The options set to something other than their default."""
    return {
        a.dest
        for a in parser._actions
        if a.dest != argparse.SUPPRESS and a.dest != "help" and getattr(args, a.dest, a.default) != a.default
    }


def value_problems(args: argparse.Namespace) -> list[str]:
    """Every option value that cannot work, found before loading, the same on every rank (sorted)."""
    problems = []
    for name, (low, high) in BOUNDS.items():
        value = getattr(args, name, None)
        if value is not None and value < low:
            problems.append(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
        elif value is not None and value > high:
            problems.append(f"--{name.replace('_', '-')} must be <= {high:,}, got {value:,}")
    problems += timeout_problems(getattr(args, "timeout", None))
    fps = getattr(args, "fps", None)
    if fps is not None and not fps > 0:  # NaN too
        problems.append(f"--fps must be > 0, got {fps}")
    if fps is not None and fps > MAX_FPS:
        problems.append(f"--fps must be <= {MAX_FPS:g}, got {fps:g}")
    problems += _layout_problems(args)
    for name in ("prompt", "negative_prompt"):
        text = getattr(args, name, None)
        if text is not None and (problem := prompt_problem(text)):
            problems.append(f"--{name.replace('_', '-')} {problem}")
    ids = getattr(args, "prompt_ids", None)
    if ids is not None and (not ids or min(ids) < 0):
        problems.append(f"--prompt-ids must list token ids >= 0, got {ids}")
    return sorted(problems)


def file_problems(args: argparse.Namespace) -> list[str]:
    """The ``--report`` file and the ``--prompts`` file, as this node's filesystem has them
    (``--output``: ``outputs.planned_outputs``; sorted)."""
    problems = []
    if getattr(args, "report", None) is not None:
        problems += writable_file("--report", args.report, getattr(args, "overwrite", False))
    prompts = getattr(args, "prompts", None)
    if prompts is not None and not os.path.exists(prompts):
        problems.append(f"--prompts {prompts}: no such file")
    elif prompts is not None and not os.path.isfile(prompts):
        problems.append(f"--prompts {prompts} is not a regular file (a directory, pipe or device); name a text file")
    return sorted(problems)


def _layout_problems(args: argparse.Namespace) -> list[str]:
    """The layout's one check (``runtime.parallel_layout``, no torch), its weight dims and its
    work dims each named by the options that asked for them."""
    world = getattr(args, "nproc_per_node", None) or _world_size()
    replicas = getattr(args, "replicas", 1)
    cfg, ulysses = getattr(args, "cfg_parallel", False), getattr(args, "ulysses", 1)
    problems = []
    if replicas is not None and replicas != 1:
        problems += [f"--{p}" for p in layout_problems(world, False, 1, replicas)]
    if cfg or ulysses != 1:
        given = " ".join((["--cfg-parallel"] if cfg else []) + ([f"--ulysses {ulysses}"] if ulysses != 1 else []))
        problems += [f"{given}: {p}" for p in layout_problems(world, cfg, ulysses)]
    return problems


def _world_size() -> int:
    """The world size torchrun announces (1 without it): known before any process group."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def unused_options(given: set[str], kind: str) -> list[str]:
    """The given options a run of ``kind`` ignores, as ``--option`` names (sorted)."""
    uses = USES.get(kind)
    if uses is None:
        return []
    return sorted(f"--{name.replace('_', '-')}" for name in given - uses - EVERY_KIND)
