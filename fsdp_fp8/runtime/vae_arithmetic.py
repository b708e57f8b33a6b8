"""The Wan VAE's peak live bytes from its config's arithmetic: decode (untiled and tiled) and
encode, the figures :mod:`fsdp_fp8.runtime.vae_trace` counts on fake tensors, without diffusers.

Each function below mirrors one of diffusers 0.42.1's ``AutoencoderKLWan`` methods on shapes
(:class:`ShapeTensor`), statement by statement. An op that makes a tensor adds its bytes to the running
total; a tensor leaves it when its last name goes, so CPython frees it where the module's own
tensor would be freed. The peak is the largest total after an op. The input counts once an op
returns a view of it, as the trace counts it.

The frames: the causal caches settle by the third call of the decoder (the encoder: by its third
4-frame chunk); later calls repeat it. So the loops run :data:`WARM` calls, then only the last;
the outputs the skipped calls would have added join in one tensor. Each distinct call is run once
and its repeats replayed (:func:`_call`). Cost: constant in frames, linear in tiles.

Design: docs/cosmos3.md, "The whole job: denoising, then the VAE".
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_fp8.errors import ArgumentError, CheckpointError
from fsdp_fp8.runtime.shape_bytes import ITEMSIZE, Run, ShapeTensor, cat, conv, like, pad

CACHE_T = 2  # diffusers' CACHE_T: frames a causal conv keeps
WARM = 3  # calls before the caches repeat


@dataclass(frozen=True)
class WanShape:
    """What the peaks depend on in an ``AutoencoderKLWan`` config (diffusers' defaults filled in)."""

    base_dim: int = 96
    decoder_base_dim: int | None = None
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    is_residual: bool = False
    out_channels: int = 3
    patch_size: int | None = None
    scale_factor_spatial: int = 8


# Keys that change no peak (the weights' shapes, the latents' statistics), and two modelled at
# one value only (``unmodelled`` names them); any other key falls back to the trace.
IGNORED_KEYS = {"in_channels", "latents_mean", "latents_std", "scale_factor_temporal"}
MODELLED_KEYS = set(WanShape.__dataclass_fields__) | IGNORED_KEYS | {"attn_scales", "dropout"}


def unmodelled(config: dict, dtype) -> list[str]:
    """Why this mirror cannot forecast ``config`` in ``dtype`` (an empty list: it can)."""
    problems = [f"`{k}`" for k in sorted(config) if not k.startswith("_") and k not in MODELLED_KEYS]
    problems = [f"{', '.join(problems)}: not modelled"] if problems else []
    if _dtype(dtype) not in ITEMSIZE:
        problems.append(f"dtype {dtype}: not modelled")
    if config.get("attn_scales", []) != []:
        problems.append(f"`attn_scales` {config['attn_scales']}: only [] is modelled")
    if config.get("dropout", 0.0) != 0.0:
        problems.append(f"`dropout` {config['dropout']}: only 0.0 is modelled")
    if not problems:
        try:
            _shape(config)
        except (TypeError, ValueError) as exc:  # WanShape's own TypeError, or our CheckpointError
            problems += [f"{p}: not modelled" for p in getattr(exc, "problems", [str(exc)])]
    return problems


def _shape(config: dict) -> WanShape:
    values = {k: config[k] for k in WanShape.__dataclass_fields__ if k in config}
    for key in ("dim_mult", "temperal_downsample"):
        if key in values:
            values[key] = tuple(values[key])
    shape = WanShape(**values)
    ints = [shape.base_dim, shape.z_dim, shape.num_res_blocks, shape.out_channels]
    ints += [shape.scale_factor_spatial, *shape.dim_mult, shape.decoder_base_dim or 1, shape.patch_size or 1]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in ints):
        raise CheckpointError(f"a size that is no positive integer in {values}", "VAE config")
    if len(shape.temperal_downsample) < len(shape.dim_mult) - 1 or not shape.dim_mult:
        raise CheckpointError(
            f"`temperal_downsample` {list(shape.temperal_downsample)} for `dim_mult` {list(shape.dim_mult)}",
            "VAE config",
        )
    return shape


def _dtype(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def decode_bytes(config: dict, latent: tuple[int, ...], dtype="float32", tiles=None) -> int:
    """Peak live bytes of ``vae.decode`` of a ``latent`` (batch, channels, frames, height, width);
    ``tiles``: ``enable_tiling``'s four sizes (None: untiled)."""
    run, a = Run(), _shape(config)
    z, ratio = run.input(tuple(latent), _dtype(dtype)), a.scale_factor_spatial
    if tiles and (latent[4] > tiles[1] // ratio or latent[3] > tiles[0] // ratio):  # as _decode decides
        _tiled_decode(run, a, z, tiles)
    else:
        _decode(run, a, z)
    return run.peak


def encode_bytes(config: dict, video: tuple[int, ...], dtype="float32") -> int:
    """Peak live bytes of ``vae.encode`` of a ``video`` (batch, channels, frames, height, width)."""
    run, a = Run(), _shape(config)
    x = run.input(tuple(video), _dtype(dtype))
    _encode(run, a, x)
    return run.peak


# --- diffusers' modules, mirrored ----------------------------------------------------------------


def _causal_conv(x: ShapeTensor, cache, out: int, kernel: int | tuple, stride=1, padding=0) -> ShapeTensor:
    """``WanCausalConv3d.forward``."""
    k, s, p = (v if isinstance(v, tuple) else (v,) * 3 for v in (kernel, stride, padding))
    pads = [p[2], p[2], p[1], p[1], 2 * p[0], 0]
    if cache is not None and pads[4] > 0:
        x = cat([cache, x], 2)
        pads[4] -= cache.shape[2]
    x = pad(x, pads)
    return conv(x, out, k, s)


def _cached_conv(x: ShapeTensor, feat: list, idx: list, out: int) -> ShapeTensor:
    """The 3x3x3 causal conv at ``feat[idx]`` with its cache: the last frames kept, then the conv."""
    i = idx[0]
    cache_x = x[:, :, -CACHE_T:].clone()
    if cache_x.shape[2] < 2 and feat[i] is not None:
        cache_x = cat([feat[i][:, :, -1].unsqueeze(2), cache_x], 2)
    x = _causal_conv(x, feat[i], out, 3, 1, 1)
    feat[i] = cache_x
    idx[0] += 1
    return x


def _rms_norm(x: ShapeTensor) -> ShapeTensor:
    """``WanRMS_norm.forward``: F.normalize (a norm, its clamp, the division), in float32 for
    16-bit inputs; then the scale, gamma and bias, each a product of ``x``'s shape."""
    upcast = x.dtype in ("float16", "bfloat16")
    normalized = _normalize(x.float() if upcast else x).to(x.dtype)
    return normalized * 1.0 * 1.0 + 0.0


def _normalize(x: ShapeTensor) -> ShapeTensor:
    """``F.normalize(x, dim=1)``."""
    denom = like(x.new((x.shape[0], 1, *x.shape[2:]))).expand_as(x)
    return x / denom


def _residual(x: ShapeTensor, in_dim: int, out_dim: int, feat: list, idx: list) -> ShapeTensor:
    """``WanResidualBlock.forward`` (dropout 0.0 makes no tensor)."""
    h = _causal_conv(x, None, out_dim, 1) if in_dim != out_dim else x
    x = _rms_norm(x)
    x = like(x)
    x = _cached_conv(x, feat, idx, out_dim)
    x = _rms_norm(x)
    x = like(x)
    x = _cached_conv(x, feat, idx, out_dim)
    return x + h


def _attention(x: ShapeTensor) -> ShapeTensor:
    """``WanAttentionBlock.forward`` (the CPU's flash attention: an output and its float32
    log-sum-exp)."""
    identity = x
    b, c, t, h, w = x.shape
    x = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
    x = _rms_norm(x)
    qkv = conv(x, c * 3, 1)
    qkv = qkv.reshape(b * t, 1, c * 3, -1)
    qkv = qkv.permute(0, 1, 3, 2).contiguous()
    q, _k, _v = qkv.chunk(3, dim=-1)
    x = _sdpa(q)
    x = x.squeeze(1).permute(0, 2, 1).reshape(b * t, c, h, w)
    x = conv(x, c, 1)
    x = x.view(b, t, c, h, w)
    x = x.permute(0, 2, 1, 3, 4)
    return x + identity


def _sdpa(q: ShapeTensor) -> ShapeTensor:
    bt, heads, length, dim = q.shape
    out = q.new((bt, length, heads, dim)).permute(0, 2, 1, 3)
    _lse = q.new((bt, heads, length), "float32")
    return out


def _mid(x: ShapeTensor, dim: int, feat: list, idx: list) -> ShapeTensor:
    """``WanMidBlock.forward``: residual, attention, residual."""
    x = _residual(x, dim, dim, feat, idx)
    x = _attention(x)
    return _residual(x, dim, dim, feat, idx)


def _resample(x: ShapeTensor, mode: str, dim: int, up_out: int, feat: list, idx: list) -> ShapeTensor:
    """``WanResample.forward``."""
    b, c, t, h, w = x.shape
    if mode == "upsample3d":
        i = idx[0]
        if feat[i] is None:
            feat[i] = "Rep"
            idx[0] += 1
        else:
            cache_x = x[:, :, -CACHE_T:].clone()
            if cache_x.shape[2] < 2 and feat[i] != "Rep":
                cache_x = cat([feat[i][:, :, -1].unsqueeze(2), cache_x], 2)
            if cache_x.shape[2] < 2 and feat[i] == "Rep":
                cache_x = cat([like(cache_x), cache_x], 2)
            x = _causal_conv(x, None if feat[i] == "Rep" else feat[i], dim * 2, (3, 1, 1), 1, (1, 0, 0))
            feat[i] = cache_x
            idx[0] += 1
            x = x.reshape(b, 2, c, t, h, w)
            x = _stack_frames(x[:, 0], x[:, 1])
            x = x.reshape(b, c, t * 2, h, w)
    t = x.shape[2]
    x = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
    x = _upsample(x, up_out) if mode.startswith("upsample") else conv(pad(x, (0, 1, 0, 1)), dim, 3, 2)
    x = x.view(b, t, x.shape[1], x.shape[2], x.shape[3]).permute(0, 2, 1, 3, 4)
    if mode == "downsample3d":
        i = idx[0]
        if feat[i] is None:
            feat[i] = x.clone()
            idx[0] += 1
        else:
            cache_x = x[:, :, -1:].clone()
            x = _causal_conv(cat([feat[i][:, :, -1:], x], 2), None, dim, (3, 1, 1), (2, 1, 1))
            feat[i] = cache_x
            idx[0] += 1
    return x


def _stack_frames(a: ShapeTensor, b: ShapeTensor) -> ShapeTensor:
    """``torch.stack((a, b), 3)``."""
    return a.new(a.shape[:3] + (2,) + a.shape[3:])


def _upsample(x: ShapeTensor, out: int) -> ShapeTensor:
    """``WanUpsample`` (nearest-exact 2x, in float32) then the 3x3 ``Conv2d``."""
    y = _nearest_2x(x.float()).to(x.dtype)
    return conv(y, out, 3, 1, 1)


def _nearest_2x(x: ShapeTensor) -> ShapeTensor:
    return x.new((*x.shape[:2], x.shape[2] * 2, x.shape[3] * 2))


def _avg_down(x: ShapeTensor, in_dim: int, out_dim: int, ft: int, fs: int) -> ShapeTensor:
    """``AvgDown3D.forward``."""
    pad_t = (ft - x.shape[2] % ft) % ft
    x = pad(x, (0, 0, 0, 0, pad_t, 0))
    b, c, t, h, w = x.shape
    x = x.view(b, c, t // ft, ft, h // fs, fs, w // fs, fs)
    x = x.permute(0, 1, 3, 5, 7, 2, 4, 6).contiguous()
    x = x.view(b, c * ft * fs * fs, t // ft, h // fs, w // fs)
    x = x.view(b, out_dim, in_dim * ft * fs * fs // out_dim, t // ft, h // fs, w // fs)
    return x.new(x.shape[:2] + x.shape[3:])  # the mean over the group


def _dup_up(x: ShapeTensor, in_dim: int, out_dim: int, ft: int, fs: int, first_chunk: bool) -> ShapeTensor:
    """``DupUp3D.forward``."""
    repeats = out_dim * ft * fs * fs // in_dim
    b, _, t, h, w = x.shape
    x = x.new((b, in_dim * repeats, t, h, w))  # repeat_interleave
    x = x.view(b, out_dim, ft, fs, fs, t, h, w)
    x = x.permute(0, 1, 5, 2, 6, 3, 7, 4).contiguous()
    x = x.view(b, out_dim, t * ft, h * fs, w * fs)
    if first_chunk:
        x = x[:, :, ft - 1 :]
    return x


def _encoder(a: WanShape, x: ShapeTensor, feat: list, idx: list, _first_chunk=False) -> ShapeTensor:
    """``WanEncoder3d.forward`` with its cache."""
    dims = [a.base_dim * u for u in (1, *a.dim_mult)]
    x = _cached_conv(x, feat, idx, dims[0])
    last = len(a.dim_mult) - 1
    for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
        temporal = a.temperal_downsample[i] if i != last else False
        mode = "downsample3d" if temporal else "downsample2d"
        if a.is_residual:
            x = _residual_down(a, x, in_dim, out_dim, temporal, i != last, feat, idx)
            continue
        for _ in range(a.num_res_blocks):
            x = _residual(x, in_dim, out_dim, feat, idx)
            in_dim = out_dim
        if i != last:
            x = _resample(x, mode, out_dim, out_dim, feat, idx)
    x = _mid(x, dims[-1], feat, idx)
    x = _rms_norm(x)
    x = like(x)
    return _cached_conv(x, feat, idx, a.z_dim * 2)


def _residual_down(a: WanShape, x: ShapeTensor, in_dim, out_dim, temporal: bool, down: bool, feat, idx) -> ShapeTensor:
    """``WanResidualDownBlock.forward`` (its input stays alive: the encoder holds it)."""
    x_copy = x.clone()
    block_in = in_dim
    for _ in range(a.num_res_blocks):
        x = _residual(x, block_in, out_dim, feat, idx)
        block_in = out_dim
    if down:
        x = _resample(x, "downsample3d" if temporal else "downsample2d", out_dim, out_dim, feat, idx)
    return x + _avg_down(x_copy, in_dim, out_dim, 2 if temporal else 1, 2 if down else 1)


def _decoder(a: WanShape, x: ShapeTensor, feat: list, idx: list, first_chunk: bool) -> ShapeTensor:
    """``WanDecoder3d.forward`` with its cache."""
    dims = [(a.decoder_base_dim or a.base_dim) * u for u in (a.dim_mult[-1], *a.dim_mult[::-1])]
    x = _cached_conv(x, feat, idx, dims[0])
    x = _mid(x, dims[0], feat, idx)
    upsample = a.temperal_downsample[::-1]
    for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
        in_dim = in_dim // 2 if i > 0 and not a.is_residual else in_dim
        up = i != len(a.dim_mult) - 1
        mode = ("upsample3d" if upsample[i] else "upsample2d") if up else None
        x = _up_block(a, x, in_dim, out_dim, mode, feat, idx, first_chunk)
    x = _rms_norm(x)
    x = like(x)
    return _cached_conv(x, feat, idx, a.out_channels)


def _up_block(
    a: WanShape, x: ShapeTensor, in_dim, out_dim, mode: str | None, feat, idx, first_chunk: bool
) -> ShapeTensor:
    """``WanResidualUpBlock.forward`` where ``is_residual``, else ``WanUpBlock.forward`` (its input
    stays alive: the decoder holds it)."""
    x_copy = x.clone() if a.is_residual else None
    block_in = in_dim
    for _ in range(a.num_res_blocks + 1):
        x = _residual(x, block_in, out_dim, feat, idx)
        block_in = out_dim
    if mode is not None:
        x = _resample(x, mode, out_dim, out_dim if a.is_residual else out_dim // 2, feat, idx)
    if mode is not None and a.is_residual:
        ft = 2 if mode == "upsample3d" else 1
        x = x + _dup_up(x_copy, in_dim, out_dim, ft, 2, first_chunk)
    return x


def _call(run: Run, coder, a: WanShape, x: ShapeTensor, feat: list, first_chunk: bool = False) -> ShapeTensor:
    """``coder(a, x, feat, [0], first_chunk)``, or the replay of its first run with the same input
    shape and cache: the peak it rose to above the total it started from, a new output, the cache
    it left (``_Calls`` in the trace does the same)."""
    key = (coder, x.shape, x.dtype, first_chunk, tuple(e.shape if isinstance(e, ShapeTensor) else e for e in feat))
    if key not in run.calls:
        start, peak = run.total, run.peak
        run.peak = start
        out = coder(a, x, feat, [0], first_chunk)
        run.calls[key] = (run.peak - start, out.shape, [e.shape if isinstance(e, ShapeTensor) else e for e in feat])
        run.peak = max(peak, run.peak)
        return out
    rise, shape, cache = run.calls[key]
    run.peak = max(run.peak, run.total + rise)
    run.paused = True
    try:
        out = x.new(shape)
        for i, entry in enumerate(cache):
            feat[i] = x.new(entry) if isinstance(entry, tuple) else entry
    finally:
        run.paused = False
    return out


def _steps(n: int):
    """``range(n)`` as (index, calls skipped before it): :data:`WARM` calls, then the last."""
    for i in range(min(n, WARM)):
        yield i, 0
    if n > WARM:
        yield n - 1, n - 1 - WARM


def _skipped(run: Run, like: ShapeTensor, frames: int) -> ShapeTensor:
    """A tensor like ``like`` of ``frames`` frames, made without a peak: the outputs of the calls
    :func:`_steps` skips. Each of them repeats the call before with more output held, so the last
    call's peak is above all of theirs."""
    run.paused = True
    try:
        return like.new(like.shape[:2] + (frames,) + like.shape[3:])
    finally:
        run.paused = False


def _slots(a: WanShape) -> int:
    """Cache entries enough for the encoder's and the decoder's cached convs (diffusers makes one
    per causal conv; the unused stay None)."""
    return 6 + len(a.dim_mult) * (2 * a.num_res_blocks + 3)


def _unpatchify(x: ShapeTensor, p: int) -> ShapeTensor:
    b, cp, f, h, w = x.shape
    x = x.view(b, cp // (p * p), p, p, f, h, w)
    x = x.permute(0, 1, 4, 5, 3, 6, 2).contiguous()
    return x.view(b, cp // (p * p), f, h * p, w * p)


def _patchify(x: ShapeTensor, p: int) -> ShapeTensor:
    b, c, f, h, w = x.shape
    if h % p != 0 or w % p != 0:
        raise ArgumentError(f"Height ({h}) and width ({w}) must be divisible by patch_size ({p})", "VAE size")
    x = x.view(b, c, f, h // p, p, w // p, p)
    x = x.permute(0, 1, 6, 4, 2, 3, 5).contiguous()
    return x.view(b, c * p * p, f, h // p, w // p)


def _decode(run: Run, a: WanShape, z: ShapeTensor) -> ShapeTensor:
    """``AutoencoderKLWan._decode``, untiled."""
    num_frame = z.shape[2]
    feat = [None] * _slots(a)
    x = _causal_conv(z, None, a.z_dim, 1)  # post_quant_conv
    out = out_ = None  # holds nothing: bound for _skipped
    for i, skipped in _steps(num_frame):
        if skipped:
            out = _skipped(run, out, out.shape[2] + skipped * out_.shape[2])
        if i == 0:
            out = _call(run, _decoder, a, x[:, :, i : i + 1], feat, True)
        else:
            out_ = _call(run, _decoder, a, x[:, :, i : i + 1], feat)
            out = cat([out, out_], 2)
    if a.patch_size is not None:
        out = _unpatchify(out, a.patch_size)
    out = like(out)  # clamp
    del feat  # clear_cache
    return out


def _tiled_decode(run: Run, a: WanShape, z: ShapeTensor, tiles) -> ShapeTensor:
    """``AutoencoderKLWan.tiled_decode``: every tile decoded, then the blends and the joins."""
    _, _, num_frames, height, width = z.shape
    ratio, p = a.scale_factor_spatial, a.patch_size
    tile_h, tile_w, stride_h, stride_w = tiles
    sample_h, sample_w = height * ratio, width * ratio
    latent_h, latent_w, latent_stride_h, latent_stride_w = (s // ratio for s in tiles)
    if not latent_stride_h or not latent_stride_w:
        raise ArgumentError(f"tile strides {stride_h}, {stride_w} under the VAE's {ratio}x compression", "VAE tiles")
    if p is not None:
        sample_h, sample_w, stride_h, stride_w = sample_h // p, sample_w // p, stride_h // p, stride_w // p
        tile_h, tile_w = tile_h // p, tile_w // p
    blend_h, blend_w = tile_h - stride_h, tile_w - stride_w
    rows = []
    feat = decoded = None
    for i in range(0, height, latent_stride_h):
        row = []
        for j in range(0, width, latent_stride_w):
            feat = [None] * _slots(a)  # clear_cache
            time = []
            for k, skipped in _steps(num_frames):
                if skipped:
                    time.append(_skipped(run, decoded, skipped * decoded.shape[2]))
                tile = z[:, :, k : k + 1, i : i + latent_h, j : j + latent_w]
                tile = _causal_conv(tile, None, a.z_dim, 1)  # post_quant_conv
                decoded = _call(run, _decoder, a, tile, feat, k == 0)
                time.append(decoded)
            row.append(cat(time, 2))
        rows.append(row)
    feat = None  # clear_cache
    result_rows = []
    for i, row in enumerate(rows):
        result_row = []
        for j, tile in enumerate(row):
            if i > 0:
                tile = _blend(rows[i - 1][j], tile, blend_h, 3)
            if j > 0:
                tile = _blend(row[j - 1], tile, blend_w, 4)
            result_row.append(tile[:, :, :, :stride_h, :stride_w])
        result_rows.append(cat(result_row, -1))
    dec = cat(result_rows, 3)[:, :, :, :sample_h, :sample_w]
    if p is not None:
        dec = _unpatchify(dec, p)
    return like(dec)  # clamp


def _blend(a: ShapeTensor, b: ShapeTensor, extent: int, dim: int) -> ShapeTensor:
    """``blend_v`` (dim 3) / ``blend_h`` (dim 4): ``b`` blended in place, a row (column) at a
    time; every row makes and frees the same temporaries, so one stands for all."""
    extent = min(a.shape[dim], b.shape[dim], extent)
    for y in range(min(extent, 1)):
        at = (slice(None),) * dim
        _ = a[(*at, -extent + y)] * (1 - y / extent) + b[(*at, y)] * (y / extent)
    return b


def _encode(run: Run, a: WanShape, x: ShapeTensor):
    """``AutoencoderKLWan.encode``, untiled: ``_encode``, then the posterior's tensors."""
    h = _encode_chunks(run, a, x)
    _mean, logvar = h.chunk(2, 1)
    logvar = like(logvar)  # clamp
    std = like(0.5 * logvar)  # exp
    var = like(logvar)  # exp
    return h, std, var


def _encode_chunks(run: Run, a: WanShape, x: ShapeTensor) -> ShapeTensor:
    """``AutoencoderKLWan._encode``: the first frame, then 4-frame chunks."""
    num_frame = x.shape[2]
    feat = [None] * _slots(a)
    if a.patch_size is not None:
        x = _patchify(x, a.patch_size)
    out = out_ = None
    for i, skipped in _steps(1 + (num_frame - 1) // 4):
        if skipped:
            out = _skipped(run, out, out.shape[2] + skipped * out_.shape[2])
        if i == 0:
            out = _call(run, _encoder, a, x[:, :, :1], feat)
        else:
            out_ = _call(run, _encoder, a, x[:, :, 1 + 4 * (i - 1) : 1 + 4 * i], feat)
            out = cat([out, out_], 2)
    enc = _causal_conv(out, None, a.z_dim * 2, 1)  # quant_conv
    del feat  # clear_cache
    return enc
