"""The VAE's phases of a job, forecast from its ``config.json``: decode (untiled and tiled) and the
encode of a conditioning video, each a peak of live tensor bytes above the VAE's weights.

It runs diffusers' own ``AutoencoderKLWan`` under ``FakeTensorMode`` and follows every storage an
op returns until it is freed. A long video runs to :data:`SIMULATED` latent frames and is extended
along a line: from the fifth frame on, the peak grows by the same bytes per frame (the encode's,
per 4-frame chunk). Each distinct decoder call is traced once per process and its repeats replayed
(``_Calls``), with the same peak.

Not counted: cuDNN / oneDNN workspaces, the allocator's caching, the latent itself.

Design: docs/cosmos3.md, "The whole job: denoising, then the VAE".
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
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
    """The peak bytes of the storages ops return, each counted while it lives (a running total:
    a storage is added when an op first returns it and taken off when it is freed)."""

    def __init__(self):
        super().__init__()
        self._live: dict[int, tuple[weakref.ref, int]] = {}
        self.total = 0
        self.peak = 0
        self.paused = False  # a replay's allocations: their peak was already counted

    def _freed(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.total -= entry[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._live:
                    nbytes = storage.nbytes()
                    self._live[key] = (weakref.ref(storage, lambda _r, key=key: self._freed(key)), nbytes)
                    self.total += nbytes
        if not self.paused:
            self.peak = max(self.peak, self.total)
        return out


@dataclass(frozen=True)
class _Traced:
    """What one call of the VAE's encoder, decoder or tile blend did to the live bytes: how far
    above its starting total they rose; its output (a new tensor's shape and dtype, or None: the
    tensor it blended into, returned); the causal cache it left (per entry: kept, a new tensor's
    shape and dtype, or the marker it set) and the cache index it moved to."""

    rise: int
    output: tuple[tuple[int, ...], torch.dtype] | None
    cache: tuple = ()
    index: int = 0


_KEPT = object()


def _signature(x: torch.Tensor) -> tuple:
    # A view of a longer latent differs only in its strides, which change nothing these calls
    # allocate (their first op makes a new tensor): whether it is contiguous is enough.
    return tuple(x.shape), x.is_contiguous(), x.dtype


def _cache_signature(cache) -> tuple:
    return tuple((tuple(e.shape), e.dtype) if isinstance(e, torch.Tensor) else e for e in cache or ())


def _shape_of(t) -> tuple[tuple[int, ...], torch.dtype] | object:
    return (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t


class _Calls:
    """The encoder's and decoder's calls and the tile blends traced once, replayed after (see
    the module's docstring)."""

    def __init__(self, peak: _Peak, traces: dict[tuple, _Traced]):
        self.peak, self.traces = peak, traces

    def wrap_coder(self, name: str, module) -> None:
        """``module.forward(x, feat_cache, feat_idx, ...)``: a new output, cache entries replaced."""
        traced_forward = module.forward

        def forward(x, feat_cache=None, feat_idx=None, **kwargs):
            feat_idx = [0] if feat_idx is None else feat_idx
            key = (name, _signature(x), tuple(sorted(kwargs.items())), _cache_signature(feat_cache), feat_idx[0])
            if (traced := self.traces.get(key)) is not None:
                return self._replay(traced, None, feat_cache, feat_idx)
            # Weak references: holding the old entries would keep them alive through the call.
            before = [weakref.ref(e) if isinstance(e, torch.Tensor) else None for e in feat_cache or ()]
            out, rise = self._rise(lambda: traced_forward(x, feat_cache=feat_cache, feat_idx=feat_idx, **kwargs))
            cache = tuple(
                _KEPT if old is not None and old() is e else _shape_of(e) for e, old in zip(feat_cache, before)
            )
            self.traces[key] = _Traced(rise, _shape_of(out), cache, feat_idx[0])
            return out

        module.forward = forward

    def wrap_blend(self, vae, name: str) -> None:
        """``vae.blend_v`` / ``blend_h(a, b, extent)``: ``b`` blended in place and returned."""
        traced_blend = getattr(vae, name)

        def blend(a, b, blend_extent):
            key = (name, _signature(a), _signature(b), blend_extent)
            if (traced := self.traces.get(key)) is not None:
                return self._replay(traced, b)
            # Each row of the blend makes and frees the same temporaries (a row of ``a`` and one
            # of ``b``, scaled, summed, copied into ``b``): the first row rises as high as all.
            out, rise = self._rise(lambda: traced_blend(a, b, min(blend_extent, 1)))
            if out is not b:
                raise RuntimeError(f"the VAE's {name} returned a new tensor, not the one it blends into")
            self.traces[key] = _Traced(rise, None)
            return out

        setattr(vae, name, blend)

    def _rise(self, call):
        """``call()`` and how far the live bytes rose above where they started, while it ran."""
        start, peak_so_far = self.peak.total, self.peak.peak
        self.peak.peak = start
        out = call()
        rise = self.peak.peak - start
        self.peak.peak = max(peak_so_far, self.peak.peak)
        return out, rise

    def _replay(self, traced: _Traced, returned, feat_cache=None, feat_idx=None):
        self.peak.peak = max(self.peak.peak, self.peak.total + traced.rise)
        self.peak.paused = True
        try:
            out = returned if traced.output is None else torch.empty(traced.output[0], dtype=traced.output[1])
            for i, entry in enumerate(traced.cache):
                if entry is not _KEPT:
                    feat_cache[i] = torch.empty(entry[0], dtype=entry[1]) if isinstance(entry, tuple) else entry
        finally:
            self.peak.paused = False
        if feat_idx is not None:
            feat_idx[0] = traced.index
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


class _FakeVAE:
    """A fake VAE of one config and dtype, built once per process (building it is most of a small
    forecast), in its own ``FakeTensorMode``, its repeated calls replayed (``_Calls``)."""

    def __init__(self, config: dict, dtype: torch.dtype):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.mode, self.dtype = FakeTensorMode(), dtype
        with self.mode:
            self.vae = _fake_vae(config, dtype, None)
        self.calls = _Calls(None, {})
        self.calls.wrap_coder("encoder", self.vae.encoder)
        self.calls.wrap_coder("decoder", self.vae.decoder)
        self.calls.wrap_blend(self.vae, "blend_v")
        self.calls.wrap_blend(self.vae, "blend_h")

    def peak(self, run, shape: tuple[int, ...], tiles) -> int:
        """The peak of ``run(vae, x)`` on a fake ``x`` of ``shape``, tiled as ``tiles`` says."""
        if tiles is None:
            self.vae.disable_tiling()
        else:
            self.vae.enable_tiling(*tiles)
        with self.mode, torch.no_grad():
            x = torch.empty(shape, dtype=self.dtype)
            with _Peak() as self.calls.peak:
                run(self.vae, x)
        return self.calls.peak.peak


_FAKE_VAES: dict[tuple, _FakeVAE] = {}


def _simulate(config: dict, dtype, tiles, run, shape: tuple[int, ...], replay: bool = True) -> int:
    """The peak of ``run(vae, x)`` on a fake VAE and a fake ``x`` of ``shape``; ``replay``: the
    encoder's and decoder's repeated calls replayed from their first trace, on the process's one
    fake VAE of this config (False: a fresh VAE, every op traced)."""
    if replay:
        key = (json.dumps(config, sort_keys=True, default=str), dtype)
        if key not in _FAKE_VAES:
            _FAKE_VAES[key] = _FakeVAE(config, dtype)
        return _FAKE_VAES[key].peak(run, shape, tiles)
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

    return _stored("decode", config, dtype, latent, tiles, lambda: _along_frames(simulate, frames, 1, SIMULATED))


def encode_bytes(config: dict, video: tuple[int, ...], dtype=torch.float32, tiles=None) -> int:
    """Peak live bytes of ``vae.encode`` of a ``video`` (batch, 3, frames, height, width)."""
    b, c, frames, h, w = video

    def simulate(n: int) -> int:
        return _simulate(config, dtype, tiles, lambda vae, x: vae.encode(x), (b, c, n, h, w))

    return _stored(
        "encode", config, dtype, video, tiles, lambda: _along_frames(simulate, frames, 4, 1 + 4 * (SIMULATED - 1))
    )


# Raised whenever the forecast's method changes: figures stored by an earlier one are then unused.
STORE_REVISION = 1
STORE_NAME = "vae-forecast.json"


def store_path() -> Path | None:
    """Where forecasts are kept between processes: ``$FSDP_FP8_CACHE`` (else ``~/.cache/fsdp_fp8``)
    / ``vae-forecast.json``; None when ``FSDP_FP8_VAE_FORECAST_STORE=off``."""
    if os.environ.get("FSDP_FP8_VAE_FORECAST_STORE") == "off":
        return None
    return Path(os.environ.get("FSDP_FP8_CACHE") or Path.home() / ".cache" / "fsdp_fp8") / STORE_NAME


def _store_key(kind: str, config: dict, dtype, shape, tiles) -> str:
    """Everything a forecast depends on: the method, the torch and diffusers that traced it, the
    VAE's config and dtype, the phase and its shape and tiles."""
    versions = []
    for package in ("torch", "diffusers"):
        try:
            versions.append(importlib.metadata.version(package))
        except importlib.metadata.PackageNotFoundError:
            versions.append(None)
    what = [STORE_REVISION, versions, config, str(dtype), kind, list(shape), list(tiles or ())]
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def _read_store(path: Path) -> dict:
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, unreadable or half-written by an older writer: recomputed
        return {}
    return stored if isinstance(stored, dict) else {}


def _stored(kind: str, config: dict, dtype, shape, tiles, compute) -> int:
    """``compute()``, or the figure an earlier process computed for the same key (a forecast is a
    pure function of it). A computed figure is added to the store by an atomic rename; a store
    that cannot be written (a read-only home) is left alone."""
    path = store_path()
    if path is None:
        return compute()
    key = _store_key(kind, config, dtype, shape, tiles)
    found = _read_store(path).get(key)
    if isinstance(found, int):
        return found
    value = compute()
    stored = _read_store(path)  # again: another process may have added figures meanwhile
    stored[key] = value
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(stored))
        os.replace(partial, path)
    return value


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
