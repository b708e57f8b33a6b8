"""What the launcher reads besides the checkpoint and writes besides the report's text: the
prompts file and the output files, every one checked before anything is loaded (no torch here).
"""

from __future__ import annotations

import os
from pathlib import Path

OUTPUT_SUFFIXES = (".png", ".mp4")


def read_prompts(args) -> list[str]:
    """The prompts (``--prompts FILE``: one per line, blank lines skipped), else ``[--prompt]``.

    A file that is not UTF-8 text is refused naming the file, the line and the byte offset.
    """
    if not args.prompts:
        return [args.prompt]
    data = Path(args.prompts).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(
            f"--prompts {args.prompts}: not UTF-8 text: line {line}, byte offset {exc.start} "
            f"(byte 0x{data[exc.start]:02x}); save the file as UTF-8"
        ) from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {args.prompts}: no prompt in the file (one prompt per line)")
    return prompts


def check_output(output: str | None) -> None:
    """Refuse an ``--output`` of a kind the launcher cannot write, or in a missing directory."""
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
    """Where prompt ``index``'s result goes: ``out.png`` itself, or ``out-007.png`` with ``--prompts``."""
    path = Path(output)
    return path.with_name(f"{path.stem}-{index:03d}{path.suffix}") if many else path


def planned_outputs(args, prompt_count: int) -> list[str]:
    """Problems with the files ``--output`` will write (one per prompt with ``--prompts``);
    ``--report`` is checked with the other values (``options.value_problems``)."""
    if not getattr(args, "output", None):
        return []
    many = args.prompts is not None
    paths = [output_path(args.output, i, many) for i in range(prompt_count if many else 1)]
    return [p for path in paths for p in writable_file("--output", path, getattr(args, "overwrite", False))]


def writable_file(option: str, path: Path, overwrite: bool) -> list[str]:
    """Why ``path`` cannot be written as a new file (empty: it can). It must be a file in a
    writable directory, and not exist unless ``overwrite``: a result is never thrown away at the
    end of a run because its path is a directory, nor a file replaced unasked."""
    path = Path(path)
    parent = path.absolute().parent
    if path.is_dir():
        return [f"{option} {path} is a directory; name a file"]
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
