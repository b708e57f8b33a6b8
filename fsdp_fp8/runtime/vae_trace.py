"""The VAE's peaks traced on fake tensors: diffusers' own ``AutoencoderKLWan`` run under
``FakeTensorMode``, every storage an op returns followed until it is freed. The reference the
config's arithmetic (:mod:`fsdp_fp8.runtime.vae_arithmetic`) is held to, and the forecast of a
config it does not model.

A long video runs to :data:`SIMULATED` latent frames and is extended along a line: from the fifth
frame on, the peak grows by the same bytes per frame (the encode's, per 4-frame chunk). Past some
tens of latent frames the joined output sets the peak and grows twice as fast: the line is then
low (30% at 48 latent frames of the demo's decode); the arithmetic has no such limit. Each
distinct decoder call is traced once per process and its repeats replayed (``_Calls``), with the
same peak.

Not counted: cuDNN / oneDNN workspaces, the allocator's caching, the latent until an op returns a
view of it.

Design: docs/cosmos3.md, "The whole job: denoising, then the VAE".
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Latent frames simulated before the peak is extended along its per-frame line.
SIMULATED = 6


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

    return _along_frames(simulate, frames, 1, SIMULATED)


def encode_bytes(config: dict, video: tuple[int, ...], dtype=torch.float32) -> int:
    """Peak live bytes of ``vae.encode`` of a ``video`` (batch, 3, frames, height, width)."""
    b, c, frames, h, w = video

    def simulate(n: int) -> int:
        return _simulate(config, dtype, None, lambda vae, x: vae.encode(x), (b, c, n, h, w))

    return _along_frames(simulate, frames, 4, 1 + 4 * (SIMULATED - 1))
