"""The VAE's phases of a job, forecast from its ``config.json``: decode (untiled and tiled) and the
encode of a conditioning video, each a peak of live tensor bytes above the VAE's weights.

The forecast runs diffusers' own ``AutoencoderKLWan`` built from the config under
``FakeTensorMode`` (tensors with shapes and no data: no memory, no arithmetic; what torchtitan's
memory estimator does for a training step) and follows every storage an op returns until it is
freed, as ``fsdp_fp8.testing.live_bytes`` does on a real CPU run. The decode's causal cache makes
the peak grow by the same bytes per latent frame from the fifth frame on (one more chunk of
output kept; checked in tests/test_vae_forecast.py), so a long video is run to ``SIMULATED``
frames and extended along that line; the encode likewise by its 4-frame chunks.

Not counted: cuDNN / oneDNN workspaces and the allocator's rounding and caching (a CUDA run's
reserved memory sits above this), the latent itself, and the pipeline's post-processing (uint8
frames on the host).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Latent frames simulated before the peak is extended along its per-frame line.
SIMULATED = 6
# diffusers' default tiles (AutoencoderKLWan.__init__: 256-pixel tiles every 192 pixels).
DEFAULT_TILES = (256, 256, 192, 192)


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
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"--vae-tiling must be auto, on or off, got {mode!r}")
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
