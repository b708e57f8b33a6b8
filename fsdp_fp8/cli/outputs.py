"""What the launcher writes besides the report's text: the output files and the report, every
one checked before anything is loaded (no torch here). The prompts file is read by
``generation.prompts``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.format.handles import SYMLINK_LOOP, broken_link
from fsdp_fp8.generation.actions import PREDICTS
from fsdp_fp8.generation.results import actions_paths, output_path

OUTPUT_SUFFIXES = (".png", ".mp4")


def check_output(output: str | None, sound: bool = False) -> None:
    """Refuse an ``--output`` of a kind the launcher cannot write, or in a missing directory. With
    ``sound`` an mp4 is written by diffusers' ``encode_video`` (PyAV), else by its
    ``export_to_video`` (imageio)."""
    if output is None:
        return
    suffix = Path(output).suffix.lower()
    if suffix not in OUTPUT_SUFFIXES:
        raise ArgumentError(
            f"--output {output}: write .png (an image, or an animated PNG of the frames) or .mp4", "launcher options"
        )
    if suffix == ".mp4" and sound:
        try:
            import av  # noqa: F401
        except ImportError:
            raise ArgumentError(
                f"--output {output} with --sound: the mp4 is written by diffusers' encode_video, which needs "
                "PyAV (pip install 'fsdp-fp8[media]', or pip install av)",
                "launcher options",
            ) from None
    elif suffix == ".mp4":
        try:
            import imageio  # noqa: F401
            import imageio_ffmpeg  # noqa: F401
        except ImportError:
            raise ArgumentError(
                f"--output {output}: mp4 needs imageio and imageio-ffmpeg "
                "(pip install imageio imageio-ffmpeg); or write .png",
                "launcher options",
            ) from None
    if not Path(output).resolve().parent.is_dir():
        raise ArgumentError(
            f"--output {output}: directory {Path(output).resolve().parent} does not exist", "launcher options"
        )


def planned_outputs(args, prompt_count: int) -> list[str]:
    """Problems with the files ``--output`` will write (one per prompt with ``--prompts``): each
    must be writable and none may be ``--report`` (the report would replace the image); the
    report itself is checked with the prompts file (``arguments.file_problems``)."""
    if not getattr(args, "output", None):
        return []
    many = args.prompts is not None
    paths = [output_path(args.output, i, many) for i in range(prompt_count if many else 1)]
    overwrite = getattr(args, "overwrite", False)
    problems = [p for path in paths for p in writable_file("--output", path, overwrite)]
    if getattr(args, "action", None) in PREDICTS:  # the predicted actions beside the video
        problems += [p for path in paths for a in actions_paths(path) for p in writable_file("--output", a, overwrite)]
    report = getattr(args, "report", None)
    if report is not None:
        for i, path in enumerate(paths):
            if not _same_file(path, Path(report)):
                continue
            if many:
                problems.append(f"--report {report} is --output {args.output}'s file for prompt {i}; name two files")
            else:
                problems.append(f"--report {report} and --output {args.output} are the same file; name two files")
    return problems


def _same_file(a: Path, b: Path) -> bool:
    """Whether writing ``a`` and ``b`` would write one file (symlinks and hard links too)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # either does not exist yet: the real paths decided
        return False


def writable_file(option: str, path: Path, overwrite: bool) -> list[str]:
    """Why ``path`` cannot be written as a new file (empty: it can). It must be a file in a
    writable directory, and not exist unless ``overwrite``: a result is never thrown away at the
    end of a run because its path is a directory, nor a file replaced unasked."""
    path = Path(path)
    parent = path.absolute().parent
    if path.is_dir():
        return [f"{option} {path} is a directory; name a file"]
    if broken_link(path) == SYMLINK_LOOP:  # a dangling link is written through (with --overwrite)
        return [f"{option} {path} is {SYMLINK_LOOP}; name a file"]
    if path.exists() and not path.is_file():  # /dev/full, a pipe (its open would block), a socket
        return [f"{option} {path} is not a regular file (a device, pipe or socket); name a file"]
    if not parent.is_dir():
        return [f"{option} {path}: directory {parent} does not exist"]
    if not os.access(parent, os.W_OK | os.X_OK):
        return [f"{option} {path}: directory {parent} is not writable"]
    if path.exists() or path.is_symlink():
        if not overwrite:
            return [f"{option} {path} already exists; pass --overwrite to replace it"]
        if not os.access(path, os.W_OK):
            return [f"{option} {path} exists and is not writable"]
    return []


def write_report(path: str, fields: dict) -> str | None:
    """Write the JSON report; the ``error:`` text when the file cannot be written (a full disk,
    a file removed or made read-only since it was checked), None when it was."""
    try:
        with open(path, "w") as f:
            json.dump(fields, f, indent=2)
    except OSError as exc:
        return f"--report {path}: cannot write the report: {exc.strerror or exc}"
    return None
