"""What the engine hands back: one ``TaskResult`` per request, the same on every rank (the frames
and the sound stay on the rank that wrote them). No torch here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

COMPLETED, FAILED, CANCELLED = "completed", "failed", "cancelled"


def output_path(output: str, index: int, many: bool) -> Path:
    """Where prompt ``index``'s result goes: ``out.png`` itself, or ``out-007.png`` with ``--prompts``."""
    path = Path(output)
    return path.with_name(f"{path.stem}-{index:03d}{path.suffix}") if many else path


def actions_paths(output: Path) -> tuple[Path, Path]:
    """Where the predicted actions of the request whose video goes to ``output`` are written:
    ``out.actions.npy`` and ``out.actions.json`` beside ``out.mp4``."""
    return output.with_name(f"{output.stem}.actions.npy"), output.with_name(f"{output.stem}.actions.json")


@dataclass
class PhaseSeconds:
    """Where one request's time went on its writing rank: reading its conditioning, the denoising
    loop (the pipeline's call), the VAE decode, writing the output."""

    prepare: float = 0.0
    denoise: float = 0.0
    decode: float = 0.0
    write: float = 0.0

    def rounded(self) -> PhaseSeconds:
        return PhaseSeconds(*(round(getattr(self, f.name), 3) for f in dataclasses.fields(self)))


@dataclass(kw_only=True)
class TaskResult:
    """One request of a run, made by the request group whose first rank is ``rank``.

    ``status``: completed, failed (``error`` says why, on every rank) or cancelled (at
    ``steps_run``). ``latent_sha256``: the final latent, the same at any world size on one machine
    and torch build; ``frames_sha256``: the decoded frames' RGB bytes; ``output``: the file
    written. ``frames`` (PIL images) and ``sound`` (a tensor) are held on the writing rank only
    and never travel."""

    index: int
    prompt: str
    rank: int
    key: str = ""
    status: str = COMPLETED
    error: str | None = None
    mode: str = ""  # "text-to-image", "image-to-video, 5 frames", ...
    steps: int = 0
    steps_run: int = 0
    precision_trace: str | None = None
    step_cache: str | None = (
        None  # the steps computed and reused: "seacache 0.25: computed 7, reused 3 (steps 4, 5, 8)"
    )
    latent_shape: list[int] = field(default_factory=list)
    latent_sha256: str = ""
    sound_sha256: str | None = None  # the audio track's samples (--sound)
    actions_shape: list[int] | None = None  # the predicted actions [T, D] (--action policy / inverse_dynamics)
    actions_sha256: str | None = None  # their float32 bytes
    frames_sha256: str | None = None
    output: str | None = None
    vae_decode: str | None = None  # how the frames were decoded: "tiled, split over 2 ranks"
    seconds: PhaseSeconds = field(default_factory=PhaseSeconds)
    peak_device_bytes: int | None = None  # the writing rank's device peak during the request (CUDA)
    peak_rss_bytes: int | None = None  # the writing rank's process peak so far (host memory)
    frames: list | None = field(default=None, repr=False, compare=False)
    sound: object | None = field(default=None, repr=False, compare=False)

    def shareable(self) -> TaskResult:
        """This result without the frames and the sound: what travels to the other ranks."""
        return dataclasses.replace(self, frames=None, sound=None)

    def to_dict(self) -> dict:
        """The JSON row: every field but the frames and the sound; unset optional ones left out."""
        out = dataclasses.asdict(self.shareable())
        for key in ("frames", "sound"):
            out.pop(key)
        optional = ("output", "sound_sha256", "actions_shape", "actions_sha256", "vae_decode", "frames_sha256")
        optional += ("error", "key", "step_cache")
        return {k: v for k, v in out.items() if k not in optional or v}


__all__ = ["CANCELLED", "COMPLETED", "FAILED", "PhaseSeconds", "TaskResult", "actions_paths", "output_path"]
