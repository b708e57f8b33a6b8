"""What the launcher reads besides the checkpoint and writes besides the report's text: the
prompts file and the output files, every one checked before anything is loaded (no torch here).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from fsdp_fp8.cli.request import Prompt
from fsdp_fp8.errors import ArgumentError

OUTPUT_SUFFIXES = (".png", ".mp4")
# A prompt's UTF-8 bytes, at most: the text encoder's attention grows with the square of its
# tokens, and a byte-level tokenizer (the demo's) makes one token per byte. 16 KiB runs 2 demo
# steps in about 10 s on one CPU core; 1 MiB never finished its first step (docs/usage.md).
MAX_PROMPT_BYTES = 16_384
MAX_PROMPTS_FILE_BYTES = 16 << 20  # the --prompts file, read whole before anything loads


def prompt_problem(text: str) -> str | None:
    """Why ``text`` cannot be a prompt (too long), or None."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_PROMPT_BYTES:
        return f"is {size:,} bytes; a prompt is at most {MAX_PROMPT_BYTES:,} bytes (UTF-8)"
    return None


def read_prompts(prompts: str | None, prompt: str) -> list[Prompt]:
    """The requests: ``--prompts FILE`` (one per line, blank lines skipped: a plain line is a
    prompt; a line starting with ``{`` a JSON object with ``"prompt"`` and optionally
    ``"negative_prompt"``, ``"image"``, ``"video"``, ``"seed"``; paths relative to the file's
    directory), else ``[prompt]``.

    A file that is not UTF-8 text is refused naming the file, the line and the byte offset; a
    file above ``MAX_PROMPTS_FILE_BYTES``, or a line above ``MAX_PROMPT_BYTES``, naming the bound;
    a JSON line that is no such object naming the line and the key.
    """
    if not prompts:
        return [Prompt(prompt)]
    lines = _prompt_lines(prompts)
    problems: list[str] = []
    read = [_prompt_of(number, line, Path(prompts).parent, problems) for number, line in lines]
    long = [f"line {p.line} {problem}" for p in read if (problem := prompt_problem(p.text))]
    problems += long
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ArgumentError(f"--prompts {prompts}: {problems[0]}{more}", "launcher options")
    return read


def _prompt_lines(prompts: str) -> list[tuple[int, str]]:
    size = os.stat(prompts).st_size
    if size > MAX_PROMPTS_FILE_BYTES:
        raise ArgumentError(
            f"--prompts {prompts} is {size:,} bytes; a prompts file is at most {MAX_PROMPTS_FILE_BYTES:,} bytes",
            "launcher options",
        )
    data = Path(prompts).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ArgumentError(
            f"--prompts {prompts}: not UTF-8 text: line {line}, byte offset {exc.start} "
            f"(byte 0x{data[exc.start]:02x}); save the file as UTF-8",
            "launcher options",
        ) from None
    lines = [(number, line.strip()) for number, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise ArgumentError(f"--prompts {prompts}: no prompt in the file (one prompt per line)", "launcher options")
    return lines


# A JSON line's keys and the types each takes (None: the command line's value)
JSON_KEYS = {"prompt": (str,), "negative_prompt": (str, type(None)), "image": (str,), "video": (str,), "seed": (int,)}


def _prompt_of(number: int, line: str, directory: Path, problems: list[str]) -> Prompt:
    """Line ``number``: its text, or (starting with ``{``) its JSON object's fields."""
    if not line.startswith("{"):
        return Prompt(line, line=number)
    try:
        fields = json.loads(line)
    except ValueError as exc:
        problems.append(f"line {number} is not a JSON object: {exc}")
        return Prompt(line, line=number)
    if not isinstance(fields, dict) or not isinstance(fields.get("prompt"), str):
        problems.append(f'line {number}: a JSON line is an object with a "prompt" string')
        return Prompt(line, line=number)
    for key in sorted(set(fields) - set(JSON_KEYS)):
        problems.append(f"line {number}: unknown key {key!r}; a JSON line takes {', '.join(JSON_KEYS)}")
    for key, types in JSON_KEYS.items():
        value = fields.get(key)
        if key in fields and (not isinstance(value, types) or isinstance(value, bool)):
            problems.append(f"line {number}: {key!r} is {value!r}; it takes a {' or '.join(t.__name__ for t in types)}")
    seed = fields.get("seed")
    if isinstance(seed, int) and not 0 <= seed < 2**63:
        problems.append(f"line {number}: 'seed' {seed} is outside 0 .. 2**63 - 1")
    paths = {k: str(directory / fields[k]) for k in ("image", "video") if isinstance(fields.get(k), str)}
    return Prompt(fields["prompt"], fields.get("negative_prompt"), seed=seed, line=number, **paths)


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


def output_path(output: str, index: int, many: bool) -> Path:
    """Where prompt ``index``'s result goes: ``out.png`` itself, or ``out-007.png`` with ``--prompts``."""
    path = Path(output)
    return path.with_name(f"{path.stem}-{index:03d}{path.suffix}") if many else path


def planned_outputs(args, prompt_count: int) -> list[str]:
    """Problems with the files ``--output`` will write (one per prompt with ``--prompts``): each
    must be writable and none may be ``--report`` (the report would replace the image); the
    report itself is checked with the prompts file (``options.file_problems``)."""
    if not getattr(args, "output", None):
        return []
    many = args.prompts is not None
    paths = [output_path(args.output, i, many) for i in range(prompt_count if many else 1)]
    problems = [p for path in paths for p in writable_file("--output", path, getattr(args, "overwrite", False))]
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
