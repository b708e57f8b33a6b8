"""The VAE's phases of a job, forecast from its ``config.json``: decode (untiled and tiled) and the
encode of a conditioning video, each a peak of live tensor bytes above the VAE's weights.

The forecast runs diffusers' own ``AutoencoderKLWan`` built from the config under
``FakeTensorMode`` (tensors with shapes and no data: no memory, no arithmetic; what torchtitan's
memory estimator does for a training step) and follows every storage an op returns until it is
freed, as ``fsdp_fp8.testing.live_bytes`` does on a real CPU run. The decode's causal cache makes
the peak grow by the same bytes per latent frame from the fifth frame on (one more chunk of
output kept; checked in tests/unit/test_vae_forecast.py), so a long video is run to ``SIMULATED``
frames and extended along that line; the encode likewise by its 4-frame chunks.

Not counted: cuDNN / oneDNN workspaces and the allocator's rounding and caching (a CUDA run's
reserved memory sits above this), the latent itself, and the pipeline's post-processing (uint8
frames on the host).
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fsdp_fp8.errors import ArgumentError

# Latent frames simulated before the peak is extended along its per-frame line.
SIMULATED = 6
# diffusers' default tiles (AutoencoderKLWan.__init__: 256-pixel tiles every 192 pixels).
DEFAULT_TILES = (256, 256, 192, 192)
MODES = ("auto", "on", "off")  # --vae-tiling


class _Peak(TorchDispatchMode):
    """The peak bytes of the storages ops return, each counted while it lives."""

    def __init__(self):
        super().__init__()
        self._live: dict[int, weakref.ref] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._live:
                    self._live[key] = weakref.ref(storage, lambda _r, key=key: self._live.pop(key, None))
        live = sum(s.nbytes() for ref in list(self._live.values()) if (s := ref()) is not None)
        self.peak = max(self.peak, live)
        return out


def _fake_vae(config: dict, dtype: torch.dtype, tiles: tuple[int, int, int, int] | None):
    from diffusers import AutoencoderKLWan

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in ``dtype``: a fake module's .to() cannot swap its parameters
    try:
        vae = AutoencoderKLWan.from_config(config)
    finally:
        torch.set_default_dtype(default)
    if tiles is not None:
        vae.enable_tiling(*tiles)
    return vae


def _simulate(config: dict, dtype, tiles, run, shape: tuple[int, ...]) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), torch.no_grad():
        vae = _fake_vae(config, dtype, tiles)
        x = torch.empty(shape, dtype=dtype)
        with _Peak() as peak:
            run(vae, x)
    return peak.peak


def _along_frames(simulate, frames: int, step: int, first: int) -> int:
    """``simulate(n)`` at ``frames``, or past ``first`` frames the line through ``first - step``
    and ``first`` frames extended to ``frames`` (in steps of ``step``)."""
    if frames <= first:
        return simulate(frames)
    before, at = simulate(first - step), simulate(first)
    return at + (frames - first) // step * (at - before)


def decode_bytes(config: dict, latent: tuple[int, ...], dtype=torch.float32, tiles=None) -> int:
    """Peak live bytes of ``vae.decode`` of a ``latent`` (batch, channels, frames, height, width)
    above the weights; ``tiles``: ``enable_tiling``'s four sizes (None: untiled)."""
    b, c, frames, h, w = latent

    def simulate(n: int) -> int:
        return _simulate(config, dtype, tiles, lambda vae, z: vae.decode(z), (b, c, n, h, w))

    return _along_frames(simulate, frames, 1, SIMULATED)


def encode_bytes(config: dict, video: tuple[int, ...], dtype=torch.float32, tiles=None) -> int:
    """Peak live bytes of ``vae.encode`` of a ``video`` (batch, 3, frames, height, width)."""
    b, c, frames, h, w = video

    def simulate(n: int) -> int:
        return _simulate(config, dtype, tiles, lambda vae, x: vae.encode(x), (b, c, n, h, w))

    return _along_frames(simulate, frames, 4, 1 + 4 * (SIMULATED - 1))


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
        )
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
