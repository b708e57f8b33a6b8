"""The VAE's phases of a job, forecast from its ``config.json``: decode (untiled and tiled) and the
encode of a conditioning video, each a peak of live tensor bytes above the VAE's weights.

The figures come from the config's arithmetic (:mod:`fsdp_fp8.runtime.vae_arithmetic`: diffusers'
``AutoencoderKLWan`` mirrored on shapes, no diffusers import, constant cost in frames). A config
it does not model is traced on fake tensors instead (:mod:`fsdp_fp8.runtime.vae_trace`: diffusers'
own module, seconds), with a warning; the job's lines say which gave the figures.

Not counted: cuDNN / oneDNN workspaces, the allocator's caching, the latent itself (until an op
returns a view of it: the tiled decode's and the encode's input count).

Design: docs/cosmos3.md, "The whole job: denoising, then the VAE".
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.runtime import vae_arithmetic

log = logging.getLogger(__name__)

# diffusers' default tiles (AutoencoderKLWan.__init__: 256-pixel tiles every 192 pixels).
DEFAULT_TILES = (256, 256, 192, 192)
MODES = ("auto", "on", "off")  # --vae-tiling
ARITHMETIC = "the config's arithmetic"


def forecast_method(config: dict, dtype) -> str:
    """Which gives this VAE's figures: :data:`ARITHMETIC`, or the trace and why."""
    problems = vae_arithmetic.unmodelled(config, dtype)
    return ARITHMETIC if not problems else f"traced on fake tensors ({'; '.join(problems)})"


def _traced(config: dict, dtype) -> bool:
    how = forecast_method(config, dtype)
    if how != ARITHMETIC:
        log.warning("VAE forecast %s: seconds instead of milliseconds", how)
    return how != ARITHMETIC


def decode_bytes(config: dict, latent: tuple[int, ...], dtype=torch.float32, tiles=None) -> int:
    """Peak live bytes of ``vae.decode`` of a ``latent`` (batch, channels, frames, height, width)
    above the weights; ``tiles``: ``enable_tiling``'s four sizes (None: untiled)."""
    if _traced(config, dtype):
        from fsdp_fp8.runtime import vae_trace

        return vae_trace.decode_bytes(config, latent, dtype, tiles)
    return vae_arithmetic.decode_bytes(config, latent, dtype, tiles)


def encode_bytes(config: dict, video: tuple[int, ...], dtype=torch.float32) -> int:
    """Peak live bytes of ``vae.encode`` of a ``video`` (batch, 3, frames, height, width)."""
    if _traced(config, dtype):
        from fsdp_fp8.runtime import vae_trace

        return vae_trace.encode_bytes(config, video, dtype)
    return vae_arithmetic.encode_bytes(config, video, dtype)


def wants_tiling(mode: str, untiled_bytes: int, budget: int | None) -> bool:
    """``--vae-tiling``: ``on`` / ``off`` as said; ``auto`` tiles when the untiled decode's
    forecast exceeds ``budget`` (the free device memory; None: nothing reports it, untiled)."""
    if mode not in MODES:
        raise ArgumentError(f"--vae-tiling must be auto, on or off, got {mode!r}", "VAE tiling")
    return mode == "on" or (mode == "auto" and budget is not None and untiled_bytes > budget)


@dataclass(frozen=True)
class Phase:
    """One phase of a job on one GPU: what stays resident beside it and its own working set."""

    name: str
    resident_bytes: int
    working_bytes: int
    detail: str = ""

    @property
    def bytes(self) -> int:
        return self.resident_bytes + self.working_bytes


@dataclass(frozen=True)
class JobForecast:
    """Every phase of one request on one GPU; a phase's peak is what stays resident beside it
    (the transformer's shards, the other components) plus its own working set."""

    phases: tuple[Phase, ...]
    method: str = ARITHMETIC  # what gave the VAE's figures (forecast_method)

    def peak(self, skip: str) -> Phase:
        """The largest phase, leaving out those whose name contains ``skip`` (the other decode)."""
        return max((p for p in self.phases if skip not in p.name), key=lambda p: p.bytes)

    def lines(self) -> list[str]:
        out = ["whole job per GPU, phase by phase (the largest sets the peak):"]
        for p in self.phases:
            out.append(f"  {p.name:<34} {_gib(p.bytes):>10}" + (f"  ({p.detail})" if p.detail else ""))
        for mode, skip in (("off", ", tiled"), ("on", ", untiled")):
            peak = self.peak(skip)
            out.append(f"  {'peak, --vae-tiling ' + mode:<34} {_gib(peak.bytes):>10}  (set by: {peak.name})")
        out.append(f"  VAE figures: {self.method}")
        return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 // 100 else f"{n / 2**20:.2f} MiB"


def job_forecast(
    vae_config: dict, denoise_bytes: int, resident_bytes: int, latent, video, dtype, tiles=DEFAULT_TILES
) -> JobForecast:
    """The phases of one request: the denoising loop (``denoise_bytes``, its own forecast), the
    VAE decode of ``latent`` untiled and tiled, and the encode of a conditioning ``video`` of the
    request's size, each beside ``resident_bytes`` (what stays on the GPU after the loop)."""
    untiled = decode_bytes(vae_config, latent, dtype)
    tiled = decode_bytes(vae_config, latent, dtype, tiles)
    encode = encode_bytes(vae_config, video, dtype)
    size = f"{tiles[0]}-pixel tiles every {tiles[2]}"
    return JobForecast(
        (
            Phase("denoising loop", denoise_bytes, 0, "the forecast above"),
            Phase("VAE decode, untiled", resident_bytes, untiled, f"latent {tuple(latent)}, {dtype}"),
            Phase("VAE decode, tiled", resident_bytes, tiled, f"{size}; split: the writing rank's"),
            Phase("VAE encode, conditioning video", resident_bytes, encode, "image / video to world"),
        ),
        forecast_method(vae_config, dtype),
    )


# The denoising forecast's terms that stay on the GPU while the VAE runs after the loop.
RESIDENT_TERMS = ("sharded weights", "resident layers", "non-FP8 components")


def vae_dtype(vae_dir: Path) -> torch.dtype:
    """The dtype most of the VAE's weights are stored in (diffusers loads them so); float32 when
    no header says."""
    from fsdp_fp8.format.safetensors_header import read_header

    counts: dict[torch.dtype, int] = {}
    for path in sorted(vae_dir.glob("*.safetensors")):
        header = read_header(path, [])
        for entry in header.tensors.values() if header else ():
            counts[entry.torch_dtype] = counts.get(entry.torch_dtype, 0) + entry.numel
    return max(counts, key=counts.get) if counts else torch.float32


def pipeline_job_forecast(root: Path, denoise, height: int, width: int, frames: int) -> JobForecast | None:
    """``job_forecast`` for the pipeline at ``root`` beside ``denoise`` (its ``MemoryForecast``),
    from ``vae/config.json`` and the VAE's headers; None when its VAE is no ``AutoencoderKLWan``."""
    config = json.loads((root / "vae" / "config.json").read_text())
    if config.get("_class_name") != "AutoencoderKLWan":
        return None
    spatial, temporal = config.get("scale_factor_spatial", 8), config.get("scale_factor_temporal", 4)
    latent = (1, config.get("z_dim", 16), (frames - 1) // temporal + 1, -(-height // spatial), -(-width // spatial))
    resident = sum(t.device_bytes for t in denoise.terms if t.name in RESIDENT_TERMS)
    dtype = vae_dtype(root / "vae")
    return job_forecast(config, denoise.device_bytes, resident, latent, (1, 3, frames, height, width), dtype)
