"""The launcher's option checks: every value before anything is loaded, and which options the
model kind uses (an option the run would ignore is said aloud, not dropped silently)."""

from __future__ import annotations

import argparse
import os

from fsdp_fp8.load.fsdp_wrap import replica_problems

# kind -> the options (argparse dests) its run reads; "pipeline" is a diffusers pipeline root,
# "cosmos3" a Cosmos 3 denoiser alone, "diffusers" any other diffusers model (one forward).
DIFFUSION = {"steps", "seed", "prompt", "guidance", "step_policy"}
USES = {
    "mot": DIFFUSION | {"latent_tokens"},
    "cosmos3": DIFFUSION | {"negative_prompt"},
    "pipeline": DIFFUSION
    | {"prompts", "negative_prompt", "output", "frames", "height", "width", "fps", "cfg_parallel"},
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
}


def given_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> set[str]:
    """The options set to something other than their default."""
    return {
        a.dest
        for a in parser._actions
        if a.dest != argparse.SUPPRESS and a.dest != "help" and getattr(args, a.dest, a.default) != a.default
    }


def value_problems(args: argparse.Namespace) -> list[str]:
    """Every option value that cannot work, found before loading (sorted)."""
    problems = []
    for name in ("steps", "latent_tokens", "new_tokens", "frames", "height", "width"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("timeout", "fps"):
        value = getattr(args, name, None)
        if value is not None and not value > 0:
            problems.append(f"--{name} must be > 0, got {value}")
    replicas = getattr(args, "replicas", 1)
    if replicas is not None and replicas != 1:
        problems += [f"--{p}" for p in replica_problems(replicas, _world_size())]
    if getattr(args, "cfg_parallel", False) and _world_size() % 2:
        problems.append(f"--cfg-parallel runs ranks in pairs: it needs an even world size, got {_world_size()}")
    ids = getattr(args, "prompt_ids", None)
    if ids is not None and (not ids or min(ids) < 0):
        problems.append(f"--prompt-ids must list token ids >= 0, got {ids}")
    if getattr(args, "report", None) is not None:  # --output: fsdp_fp8.cli.generate.check_output
        problems += _writable_file("--report", args.report)
    prompts = getattr(args, "prompts", None)
    if prompts is not None and not os.path.isfile(prompts):
        problems.append(f"--prompts {prompts}: no such file")
    return sorted(problems)


def _world_size() -> int:
    """The world size torchrun announces (1 without it): known before any process group."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _writable_file(option: str, path: str) -> list[str]:
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return [f"{option} {path} is a directory; name a file"]
    if not os.path.isdir(parent):
        return [f"{option} {path}: directory {parent} does not exist"]
    if not os.access(parent, os.W_OK):
        return [f"{option} {path}: directory {parent} is not writable"]
    return []


def unused_options(given: set[str], kind: str) -> list[str]:
    """The given options a run of ``kind`` ignores, as ``--option`` names (sorted)."""
    uses = USES.get(kind)
    if uses is None:
        return []
    return sorted(f"--{name.replace('_', '-')}" for name in given - uses - EVERY_KIND)
