"""The launcher's options as frozen values, made once from the parsed ``Namespace``.

``arguments.parse_run_args`` checks every value before torch loads; ``job_of`` then turns the
``Namespace`` into a ``Job``: what to generate (``GenerationRequest``), how to load and run it
(``RunSettings``) and which options were given (for the "ignored" warning). Each field is named
after its option's argparse ``dest``, one field per option, so adding an option is a field here,
its check (``options``), its use and its row in docs/usage.md; ``tests/unit/test_run_values.py`` holds
every option to exactly one field and one row of ``options.USES`` / ``options.EVERY_KIND``. The
``Namespace`` stops here: the run (``runner``, ``generate``) and every layer below read values.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    """One request of a run: ``--prompt`` (with ``--image`` / ``--video``), or one line of
    ``--prompts`` (a plain line: its text; a JSON line: its own fields, ``None`` where it takes
    the command line's). ``line``: where in the file (0: the command line)."""

    text: str
    negative_prompt: str | None = None
    image: str | None = None
    video: str | None = None
    seed: int | None = None
    line: int = 0

    def mode(self, frames: int | None, sound: bool = False) -> str:
        """The kind of job in words, as the report names it: ``image-to-video, 9 frames, sound``."""
        source = "image" if self.image else "video" if self.video else "text"
        if frames == 1 and source == "text" and not sound:
            return "text-to-image"
        return f"{source}-to-video" + (f", {frames} frames" if frames else "") + (", sound" if sound else "")


@dataclass(frozen=True)
class GenerationRequest:
    """What one run generates: the prompt(s), the sampling and the sizes (``None``: the demo's,
    else the pipeline's)."""

    prompt: str
    negative_prompt: str | None = None
    prompts: str | None = None  # the --prompts file
    steps: int = 20
    seed: int = 0
    guidance: float = 3.0
    step_policy: str = "auto"
    frames: int | None = None
    height: int | None = None
    width: int | None = None
    fps: float = 24.0
    output: str | None = None
    latent_tokens: int = 64
    prompt_ids: tuple[int, ...] | None = None
    new_tokens: int = 8
    image: str | None = None
    video: str | None = None
    condition_frames: tuple[int, ...] | None = None
    condition_keep: str | None = None
    sound: bool = False

    def sizes(self) -> dict:
        """The pipeline's size keywords that are set (``num_frames``, ``height``, ``width``)."""
        named = (("num_frames", self.frames), ("height", self.height), ("width", self.width))
        return {key: value for key, value in named if value is not None}

    def with_default_sizes(self, sizes: dict) -> GenerationRequest:
        """The request with each unset size taken from ``sizes`` (pipeline keyword names)."""
        fields = {"frames": "num_frames", "height": "height", "width": "width"}
        chosen = {name: sizes[key] for name, key in fields.items() if getattr(self, name) is None and key in sizes}
        return dataclasses.replace(self, **chosen)


@dataclass(frozen=True)
class RunSettings:
    """How the launcher loads and runs: the checkpoint, the ranks' layout, memory, quantization
    and the report."""

    checkpoint: str | None = None
    nproc_per_node: int | None = None
    replicas: int = 1
    resident: str = "none"
    resident_budget: int | None = None
    timeout: float = 600.0
    ulysses: int = 1
    cfg_parallel: bool = False
    attention_backend: str = "native"
    safety_check: str = "on"
    vae_tiling: str = "auto"
    quantize: str | None = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    report: str | None = None
    overwrite: bool = False


@dataclass(frozen=True)
class Job:
    """One launcher run: the request, the settings, and the options given on the command line."""

    request: GenerationRequest
    settings: RunSettings
    given: frozenset[str] = frozenset()


def _tupled(value):
    return tuple(value) if isinstance(value, list) else value


def _fields_of(cls, args: argparse.Namespace) -> dict:
    return {f.name: _tupled(getattr(args, f.name)) for f in dataclasses.fields(cls)}


def job_of(args: argparse.Namespace) -> Job:
    """The frozen values of parsed (and checked) arguments; the one place a ``Namespace`` is read."""
    return Job(
        request=GenerationRequest(**_fields_of(GenerationRequest, args)),
        settings=RunSettings(**_fields_of(RunSettings, args)),
        given=frozenset(getattr(args, "given", ())),
    )


def value_fields() -> dict[str, str]:
    """Every option ``dest`` the values hold -> the value class holding it."""
    return {f.name: cls.__name__ for cls in (GenerationRequest, RunSettings) for f in dataclasses.fields(cls)}


__all__ = ["GenerationRequest", "Job", "Prompt", "RunSettings", "job_of", "value_fields"]
