"""An HTTP request's fields as the launcher's values, checked with the launcher's own checks.

The OpenAI Videos API's fields (``prompt``, ``size`` "WxH", ``seconds``, ``model``,
``input_reference``) and the field's common extras (``negative_prompt``, ``width``, ``height``,
``num_frames``, ``fps``, ``num_inference_steps``, ``guidance_scale``, ``seed``,
``generate_sound``), the launcher's Cosmos 3 conditioning (``condition_frames``,
``condition_keep``, ``flow_shift``) and an action job's fields in vLLM-Omni's names
(``action_mode``, ``domain_name``, ``action_chunk_size``, ``resolution``, ``action``; ours beside
them: ``chunk_size``, ``resolution_tier``, ``actions``) become one ``GenerationRequest``; then the
checks the launcher makes before its load (bounds, choices, sizes the VAE can make, sound without
a sound tokenizer, image and clip headers, an action job's domain, inputs and raw actions, their
combinations) run on it, and every problem is one line of the 400 answer. The raw actions (rows of
numbers, or their JSON text in a form) are kept as a ``.json`` file, read by the launcher's own
reader (``generation.actions``). No torch here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from fsdp_fp8.generation.checks import conditioning_problems, value_problems
from fsdp_fp8.generation.declare import declared
from fsdp_fp8.generation.inputs import pipeline_problems
from fsdp_fp8.generation.media import IMAGE_FORMATS
from fsdp_fp8.generation.values import GenerationRequest, OptionValues, RunSettings

# request field -> (GenerationRequest field, its type); the API's names, then ours
FIELDS = {
    "prompt": ("prompt", str),
    "negative_prompt": ("negative_prompt", str),
    "num_inference_steps": ("steps", int),
    "steps": ("steps", int),
    "guidance_scale": ("guidance", float),
    "seed": ("seed", int),
    "width": ("width", int),
    "height": ("height", int),
    "num_frames": ("frames", int),
    "fps": ("fps", float),
    "generate_sound": ("sound", bool),
    "condition_frames": ("condition_frames", "indexes"),
    "condition_keep": ("condition_keep", str),
    "flow_shift": ("flow_shift", float),
    "action_mode": ("action", str),
    "domain_name": ("domain", str),
    "action_chunk_size": ("chunk_size", int),
    "chunk_size": ("chunk_size", int),
    "resolution": ("resolution_tier", int),
    "resolution_tier": ("resolution_tier", int),
    "action": ("actions", "rows"),
    "actions": ("actions", "rows"),
}
OTHER_FIELDS = ("size", "seconds", "model", "input_reference")
# the declared choices of the fields that have them (the command line's argparse checks its own)
CHOICES = {name: meta.cli["choices"] for name, _, meta in declared(GenerationRequest) if "choices" in meta.cli}
CONTAINER_MAGIC = {b"ftyp": ".mp4", b"\x1aE\xdf\xa3": ".webm"}


@dataclass(frozen=True)
class Upload:
    """An ``input_reference``: its bytes, the name it came with, its kind (image or video) and the
    suffix it is kept with (what diffusers' readers go by)."""

    data: bytes
    filename: str
    kind: str
    suffix: str


@dataclass(frozen=True)
class Submission:
    """A request as the launcher's values: its ``GenerationRequest`` (``actions`` unset), the raw
    actions sent with it (rows as sent; kept beside the job as a ``.json`` file), and the
    ``GenerationRequest`` fields it set (a distilled root's schedule fills the others)."""

    request: GenerationRequest
    actions: list | None = None
    given: frozenset[str] = frozenset()


TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
KIND_WORDS = {
    int: "an integer",
    float: "a finite number",
    bool: "true or false",
    "indexes": "frame indexes",
    "rows": "a list of lists of numbers (the raw actions [T, D]), or its JSON text",
}


def _typed(name: str, value, kind) -> tuple[object, str | None]:
    """``value`` as ``kind`` (form fields arrive as text), or the problem."""
    if value is None:
        return None, None
    converted = _converted(value, kind)
    if converted is _REFUSED:
        return None, f"`{name}` must be {KIND_WORDS.get(kind, 'text')}, got {value!r}"
    return converted, None


_REFUSED = object()


def _converted(value, kind):
    """``value`` as ``kind``, or ``_REFUSED``."""
    if kind is str:
        return str(value)
    if kind is bool:
        if isinstance(value, bool):
            return value
        word = str(value).lower()
        return word in TRUE if word in TRUE + FALSE else _REFUSED
    if kind == "rows":  # its numbers are read by generation.actions.read_actions, as a file's are
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                return _REFUSED
        return value if isinstance(value, list) else _REFUSED
    if isinstance(value, bool):
        return _REFUSED  # JSON's true is no number
    if kind == "indexes":
        items = value if isinstance(value, list) else str(value).split(",")
        numbers = [_converted(i, int) for i in items if str(i).strip()]
        return _REFUSED if _REFUSED in numbers else tuple(numbers)
    try:
        number = float(value) if kind is float or isinstance(value, float) else int(str(value).strip())
    except (TypeError, ValueError):
        return _REFUSED
    if not math.isfinite(number):
        return _REFUSED
    if kind is int:
        return int(number) if float(number).is_integer() else _REFUSED
    return number


def sniff_upload(data: bytes, filename: str) -> Upload | str:
    """What an ``input_reference`` is, from its bytes: an image (PNG, JPEG, WebP; one frame), a
    clip (an animated GIF or PNG, an mp4, a WebM), or the problem."""
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            fmt, frames = image.format, getattr(image, "n_frames", 1)
    except Exception:  # noqa: BLE001 - not an image PIL knows: perhaps a container
        fmt, frames = None, 0
    if fmt is not None and frames > 1 and fmt in ("GIF", "PNG"):
        return Upload(data, filename, "video", ".gif" if fmt == "GIF" else ".png")
    if fmt in IMAGE_FORMATS:
        return Upload(data, filename, "image", {"PNG": ".png", "JPEG": ".jpg", "WEBP": ".webp"}[fmt])
    for magic, suffix in CONTAINER_MAGIC.items():
        if magic in data[:64]:
            return Upload(data, filename, "video", suffix)
    return (
        f"`input_reference` ({filename or 'the upload'}) is neither an image (PNG, JPEG, WebP) nor a clip "
        "(an mp4, a WebM, an animated GIF or PNG)"
    )


def request_of(fields: dict, upload: Upload | None, temporal: int) -> tuple[Submission | None, list[str]]:
    """The ``Submission`` of a request's fields (None with the problems found)."""
    problems = [f"unknown field `{k}`; this server takes {', '.join([*FIELDS, *OTHER_FIELDS])}" for k in fields if
                k not in FIELDS and k not in OTHER_FIELDS]  # fmt: skip
    values = {}
    for name, (target, kind) in FIELDS.items():
        value, problem = _typed(name, fields.get(name), kind)
        if problem:
            problems.append(problem)
        elif value is not None:
            if target in values and values[target] != value:
                problems.append(f"`{name}` {value!r} and another name of it ({values[target]!r}) disagree; give one")
            elif target in CHOICES and value not in CHOICES[target]:
                choices = ", ".join(str(c) for c in CHOICES[target])
                problems.append(f"`{name}` must be one of {choices}, got {value!r}")
            values[target] = value
    if not isinstance(values.get("prompt"), str) or not values["prompt"].strip():
        problems.append("`prompt` is required: the text to generate from")
    problems += _size(fields.get("size"), values)
    problems += _seconds(fields.get("seconds"), values, temporal)
    if isinstance(fields.get("input_reference"), dict | str):
        problems.append("`input_reference` must be a file uploaded as multipart/form-data (an image or a clip)")
    if problems:
        return None, problems
    given = frozenset(values)
    actions = values.pop("actions", None)
    if upload is not None:
        values[upload.kind] = upload.filename or f"upload{upload.suffix}"
    return Submission(dataclasses.replace(GenerationRequest(), **values), actions, given), []


def _size(size, values: dict) -> list[str]:
    """``size`` "WxH" into width and height (each, if also given, must agree)."""
    if size is None:
        return []
    parts = str(size).lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        return [f"`size` must be WIDTHxHEIGHT in pixels (such as 1280x720), got {size!r}"]
    width, height = (int(p) for p in parts)
    problems = []
    for name, value in (("width", width), ("height", height)):
        if values.get(name, value) != value:
            problems.append(f"`size` {size} and `{name}` {values[name]} disagree; give one")
        values[name] = value
    return problems


def _seconds(seconds, values: dict, temporal: int) -> list[str]:
    """``seconds`` into frames at the request's fps: the VAE's nearest frame count (1 + a
    multiple of its temporal factor), unless ``num_frames`` says otherwise."""
    if seconds is None:
        return []
    length = _converted(seconds, float)
    if length is _REFUSED or length <= 0:
        return [f"`seconds` must be a number above 0, got {seconds!r}"]
    fps = values.get("fps", GenerationRequest.fps)
    frames = 1 + max(1, round(length * fps / temporal)) * temporal
    if "frames" in values and values["frames"] != frames:
        return [f"`seconds` {seconds} ({frames} frames at {fps:g} fps) and `num_frames` {values['frames']} disagree"]
    values["frames"] = frames
    return []


def request_problems(
    request: GenerationRequest, settings: RunSettings, root: Path | None, upload_path, actions_path=None
) -> list[str]:
    """The launcher's checks of ``request`` against the served pipeline (``root``; None: the
    demo), the upload read at ``upload_path``, the raw actions at ``actions_path`` (their lines
    name the field ``actions``, not the server's file)."""
    if upload_path is not None:
        kind = "image" if request.image else "video"
        request = dataclasses.replace(request, **{kind: str(upload_path)})
    if actions_path is not None:
        request = dataclasses.replace(request, actions=str(actions_path))
    values = OptionValues(request, settings)
    problems = value_problems(values) + pipeline_problems(values, root)
    problems += conditioning_problems(values, [])  # the upload's header and frames too
    if actions_path is not None:
        problems = [p.replace(f"--actions {actions_path}", "`actions`") for p in problems]
    return sorted(set(problems))


__all__ = ["FIELDS", "Submission", "Upload", "request_of", "request_problems", "sniff_upload"]
