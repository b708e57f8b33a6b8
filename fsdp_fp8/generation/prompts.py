"""The requests of a run: ``--prompt``, or the ``--prompts`` file (one request per line, plain
text or a JSON object), read whole and checked before anything is loaded. No torch here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.generation.values import Prompt

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
    if problems:  # every line's problems at once, as every other usage error
        raise ArgumentError([f"--prompts {prompts}: {p}" for p in problems], "launcher options")
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
TYPE_WORDS = {str: "a string", int: "an integer", type(None): "null"}  # JSON's words for them


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
            problems.append(
                f"line {number}: {key!r} is {value!r}; it takes {' or '.join(TYPE_WORDS[t] for t in types)}"
            )
    seed = fields.get("seed")
    if isinstance(seed, int) and not 0 <= seed < 2**63:
        problems.append(f"line {number}: 'seed' {seed} is outside 0 .. 2**63 - 1")
    paths = {k: str(directory / fields[k]) for k in ("image", "video") if isinstance(fields.get(k), str)}
    return Prompt(fields["prompt"], fields.get("negative_prompt"), seed=seed, line=number, **paths)
