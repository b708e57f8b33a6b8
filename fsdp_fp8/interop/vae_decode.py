"""diffusers' tiled VAE decode split over the ranks of one request, bit for bit the one-rank result.

A tile of ``AutoencoderKLWan.tiled_decode`` reads nothing of another tile, so any rank may decode
it. Tiles go largest first to the least-loaded rank (:func:`assign_tiles`). The writer (the rank
that saves the request) gathers them and blends with diffusers' own ``blend_v`` / ``blend_h``.
Only the writer holds the whole video; the others return None.

The ranks compare the latent and tile settings before any transfer, and every decode's failure
after it, so all raise alike, never hang. On CPU the decode runs on one intra-op thread
(:func:`one_thread_on_cpu`). tests/distributed/test_vae_decode.py guards diffusers' private seams.

Design: docs/interop.md, "The VAE decode over a request's ranks".
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.runtime.allgather_meter import all_gather_into
from fsdp_fp8.runtime.residency import device_budget
from fsdp_fp8.runtime.vae_forecast import decode_bytes, wants_tiling

# The dtypes a signature can name (its index travels; a dtype not listed is refused alike on every rank).
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_SHAPE_DIMS = 5  # a decoded tile: (batch, channels, frames, height, width)


@dataclass(frozen=True)
class TilePlan:
    """The tiles ``tiled_decode`` makes of a latent, in its order, with its blend sizes."""

    starts_h: tuple[int, ...]  # latent rows where each tile row starts
    starts_w: tuple[int, ...]
    tile_h: int  # latent tile height / width (tile_sample_min // compression)
    tile_w: int
    stride_h: int  # decoded rows / columns each tile keeps (after the patch size)
    stride_w: int
    blend_h: int  # decoded rows / columns blended with the neighbour above / to the left
    blend_w: int
    sample_h: int  # decoded height / width before unpatchify
    sample_w: int
    batches: tuple[tuple[int, int], ...]  # (start, size) per batch slice (use_slicing: one each)

    @property
    def tiles(self) -> list[tuple[int, int, int]]:
        """Every tile as (batch slice, row, column), in the order tiled_decode decodes them."""
        grid = [(r, c) for r in range(len(self.starts_h)) for c in range(len(self.starts_w))]
        return [(b, r, c) for b in range(len(self.batches)) for r, c in grid]

    def area(self, tile: tuple[int, int, int], height: int, width: int) -> int:
        """The latent pixels of ``tile`` (edge tiles are smaller): its decode's cost."""
        b, r, c = tile
        rows = min(self.tile_h, height - self.starts_h[r])
        return self.batches[b][1] * rows * min(self.tile_w, width - self.starts_w[c])


def is_tiled(vae, shape: tuple[int, ...]) -> bool:
    """Whether ``vae.decode`` of a latent of ``shape`` takes ``tiled_decode`` (its ``_decode``'s test)."""
    ratio = vae.spatial_compression_ratio
    height, width = shape[-2], shape[-1]
    return bool(vae.use_tiling) and (
        width > vae.tile_sample_min_width // ratio or height > vae.tile_sample_min_height // ratio
    )


def tile_plan(vae, shape: tuple[int, ...]) -> TilePlan:
    """``tiled_decode``'s tiles and sizes for a latent of ``shape``, computed as it computes them."""
    ratio, patch = vae.spatial_compression_ratio, vae.config.patch_size or 1
    batch, height, width = shape[0], shape[-2], shape[-1]
    stride_h, stride_w = vae.tile_sample_stride_height // ratio, vae.tile_sample_stride_width // ratio
    out_stride_h, out_stride_w = vae.tile_sample_stride_height // patch, vae.tile_sample_stride_width // patch
    slices = vae.use_slicing and batch > 1
    return TilePlan(
        starts_h=tuple(range(0, height, stride_h)),
        starts_w=tuple(range(0, width, stride_w)),
        tile_h=vae.tile_sample_min_height // ratio,
        tile_w=vae.tile_sample_min_width // ratio,
        stride_h=out_stride_h,
        stride_w=out_stride_w,
        blend_h=vae.tile_sample_min_height // patch - out_stride_h,
        blend_w=vae.tile_sample_min_width // patch - out_stride_w,
        sample_h=height * ratio // patch,
        sample_w=width * ratio // patch,
        batches=tuple((b, 1) for b in range(batch)) if slices else ((0, batch),),
    )


def assign_tiles(costs: list[int], ranks: int) -> list[list[int]]:
    """Tile indices per rank: the largest tile first, each to the least-loaded rank (ties: the
    lowest tile index, the lowest rank), each rank's tiles in ascending order. Pure: every rank
    computes the same."""
    loads, owned = [0] * ranks, [[] for _ in range(ranks)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(ranks), key=lambda r: (loads[r], r))
        loads[rank] += costs[index]
        owned[rank].append(index)
    return [sorted(tiles) for tiles in owned]


def decode_tile(vae, z: torch.Tensor, plan: TilePlan, tile: tuple[int, int, int]) -> torch.Tensor:
    """One tile through every frame: ``tiled_decode``'s inner loop, unchanged (its causal cache
    cleared before and after)."""
    b, r, c = tile
    start, size = plan.batches[b]
    i, j = plan.starts_h[r], plan.starts_w[c]
    z = z.narrow(0, start, size)
    vae.clear_cache()
    frames = []
    for k in range(z.shape[2]):
        vae._conv_idx = [0]
        piece = vae.post_quant_conv(z[:, :, k : k + 1, i : i + plan.tile_h, j : j + plan.tile_w])
        frames.append(vae.decoder(piece, feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=(k == 0)))
    vae.clear_cache()
    return torch.cat(frames, dim=2)


def blend_tiles(vae, plan: TilePlan, decoded: dict[tuple[int, int, int], torch.Tensor]) -> torch.Tensor:
    """``tiled_decode``'s second half on every tile: blend (diffusers' own ``blend_v`` /
    ``blend_h``, in place, in its order), crop, unpatchify, clamp; batch slices concatenated as
    ``decode`` does under ``use_slicing``."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    outputs = []
    for b in range(len(plan.batches)):
        rows = [[decoded[(b, r, c)] for c in range(len(plan.starts_w))] for r in range(len(plan.starts_h))]
        result_rows = []
        for i, row in enumerate(rows):
            result_row = []
            for j, tile in enumerate(row):
                if i > 0:
                    tile = vae.blend_v(rows[i - 1][j], tile, plan.blend_h)
                if j > 0:
                    tile = vae.blend_h(row[j - 1], tile, plan.blend_w)
                result_row.append(tile[:, :, :, : plan.stride_h, : plan.stride_w])
            result_rows.append(torch.cat(result_row, dim=-1))
        dec = torch.cat(result_rows, dim=3)[:, :, :, : plan.sample_h, : plan.sample_w]
        if vae.config.patch_size is not None:
            dec = unpatchify(dec, patch_size=vae.config.patch_size)
        outputs.append(torch.clamp(dec, min=-1.0, max=1.0))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def pack(tiles: list[torch.Tensor], device) -> torch.Tensor:
    """A rank's decoded tiles as one contiguous byte buffer (in its tile order)."""
    if not tiles:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tiles])


def unpack(buffer: torch.Tensor, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """``pack``'s inverse: views of ``buffer`` (bytes) as tiles of ``shapes`` and ``dtype``."""
    itemsize, tiles, offset = torch.empty(0, dtype=dtype).element_size(), [], 0
    for shape in shapes:
        nbytes = itemsize * _numel(shape)
        tiles.append(buffer.narrow(0, offset, nbytes).view(dtype).view(shape))
        offset += nbytes
    return tiles


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def packed_bytes(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> int:
    return sum(_numel(s) for s in shapes) * torch.empty(0, dtype=dtype).element_size()


def signature(vae, z: torch.Tensor) -> list[int]:
    """What the ranks of a request must agree on before they split a decode, as integers."""
    dtype = _DTYPES.index(z.dtype) if z.dtype in _DTYPES else -1
    tiles = (vae.tile_sample_min_height, vae.tile_sample_min_width)
    strides = (vae.tile_sample_stride_height, vae.tile_sample_stride_width)
    flags = (int(vae.use_tiling), int(vae.use_slicing), vae.config.patch_size or 0, vae.spatial_compression_ratio)
    shape = (list(z.shape) + [0] * _SHAPE_DIMS)[:_SHAPE_DIMS]
    # The ranks hold the same latent bit for bit (CFG pair, sequence group): a sum's bits say so
    # cheaply; a rank whose latent differs would blend its tiles into another rank's frames.
    checksum = int(z.detach().double().sum().view(torch.int64).item())
    return [z.dim(), *shape, dtype, *tiles, *strides, *flags, checksum]


# ``signature``'s integers, named for the refusal's message.
SIGNATURE_FIELDS = ("dims", "batch", "channels", "frames", "height", "width", "dtype", "tile height", "tile width")
SIGNATURE_FIELDS += ("stride height", "stride width", "tiling", "slicing", "patch size", "compression", "latent sum")


class RequestDecode:
    """One rank's side of the split decode of a request: ``group`` holds the request's ranks,
    ``index`` is this rank's place in it, ``writer`` the place of the rank that keeps the frames."""

    def __init__(self, group, index: int, size: int, writer: int = 0):
        self.group, self.index, self.size, self.writer = group, index, size, writer
        self.sent_bytes = 0  # what this rank sent of its tiles in the last decode (0 on the writer)

    def decode(self, vae, z: torch.Tensor) -> torch.Tensor | None:
        """``vae.decode(z).sample`` on the writer, split over the group where diffusers tiles;
        ``None`` elsewhere. Collective over the group."""
        self._agree(vae, z)
        if not is_tiled(vae, tuple(z.shape)):  # diffusers decodes it whole: the writer alone does
            return vae.decode(z).sample if self.index == self.writer else None
        plan = tile_plan(vae, tuple(z.shape))
        tiles = plan.tiles
        owned = assign_tiles([plan.area(t, z.shape[-2], z.shape[-1]) for t in tiles], self.size)
        mine, error = self._decode_mine(vae, z, plan, [tiles[i] for i in owned[self.index]])
        shapes = self._exchange_shapes(mine, error, max(len(o) for o in owned), z.device)
        if self.index != self.writer:
            self._send(pack(mine, z.device))
            return None
        decoded = {}
        for place, indices in enumerate(owned):
            got = mine if place == self.writer else self._receive(place, shapes[place], z.dtype, z.device)
            decoded.update((tiles[i], tile) for i, tile in zip(indices, got))
        return blend_tiles(vae, plan, decoded)

    def any(self, flag: bool, device) -> bool:
        """Whether ``flag`` holds on any rank of the group (one tiny all-reduce)."""
        t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def _decode_mine(self, vae, z, plan, tiles) -> tuple[list[torch.Tensor], BaseException | None]:
        try:
            with torch.no_grad():
                return [decode_tile(vae, z, plan, tile) for tile in tiles], None
        except Exception as exc:  # every rank learns of it in the shape exchange, then all raise
            return [], exc

    def _agree(self, vae, z: torch.Tensor) -> None:
        mine = torch.tensor(signature(vae, z), dtype=torch.int64, device=z.device)
        every = self._all_gather(mine)
        rows = [every[r].tolist() for r in range(self.size)]
        differ = [name for k, name in enumerate(SIGNATURE_FIELDS) if len({row[k] for row in rows}) > 1]
        if differ:
            told = "; ".join(f"rank {r}: {dict(zip(SIGNATURE_FIELDS, row))}" for r, row in enumerate(rows))
            raise ArgumentError(
                f"the split VAE decode needs every rank of a request to hold the same latent and tiling; "
                f"they differ in {differ}: {told}",
                "split VAE decode",
            )
        if rows[0][0] != _SHAPE_DIMS or rows[0][SIGNATURE_FIELDS.index("dtype")] < 0:
            raise ArgumentError(
                f"the split VAE decode takes a 5-d (batch, channels, frames, height, width) latent of "
                f"{', '.join(str(d).removeprefix('torch.') for d in _DTYPES)}; got shape "
                f"{tuple(z.shape)} of {z.dtype}",
                "split VAE decode",
            )

    def _exchange_shapes(self, mine, error, most: int, device) -> list[list[tuple[int, ...]]]:
        """Every rank's decoded tile shapes (and whether its decode failed), on every rank."""
        flat = [1 if error is not None else 0] + [n for t in mine for n in t.shape]
        flat += [0] * (1 + most * _SHAPE_DIMS - len(flat))
        every = self._all_gather(torch.tensor(flat, dtype=torch.int64, device=device))
        rows = [every[r].tolist() for r in range(self.size)]
        failed = [r for r, row in enumerate(rows) if row[0]]
        if failed:
            here = f"; here: {type(error).__name__}: {error}" if error is not None else ""
            raise RuntimeError(f"the split VAE decode failed on rank(s) {failed} of this request{here}") from error
        counts = [sum(1 for k in range(most) if row[1 + k * _SHAPE_DIMS]) for row in rows]
        return [
            [tuple(row[1 + k * _SHAPE_DIMS : 1 + (k + 1) * _SHAPE_DIMS]) for k in range(counts[r])]
            for r, row in enumerate(rows)
        ]

    def _all_gather(self, mine: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.size * mine.numel(), dtype=mine.dtype, device=mine.device)
        all_gather_into(out, mine, group=self.group)
        return out.view(self.size, mine.numel())

    def _send(self, buffer: torch.Tensor) -> None:
        self.sent_bytes = buffer.numel()
        if buffer.numel():
            dist.send(buffer, dst=dist.get_global_rank(self.group, self.writer), group=self.group)

    def _receive(self, place: int, shapes, dtype, device) -> list[torch.Tensor]:
        buffer = torch.empty(packed_bytes(shapes, dtype), dtype=torch.uint8, device=device)
        if buffer.numel():
            dist.recv(buffer, src=dist.get_global_rank(self.group, place), group=self.group)
        return unpack(buffer, shapes, dtype)


def request_decode(mesh) -> RequestDecode | None:
    """This rank's ``RequestDecode`` over the ranks of its request (``mesh.request_ranks`` of the
    layout's ``ParallelMesh``, the writer first); ``None`` without a mesh or when a request has one
    rank."""
    team = mesh.request_ranks if mesh is not None else None
    if team is None:
        return None
    return RequestDecode(team.get_group(), team.get_local_rank(), team.size())


@contextlib.contextmanager
def one_thread_on_cpu(device: torch.device):
    """On a CPU device, run the block on one intra-op thread (the count is put back after): the
    decoded frames are then the same bytes at any world size and thread count. On CUDA nothing
    changes."""
    if device.type != "cpu" or torch.get_num_threads() == 1:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def decode_video(pipe, latents: torch.Tensor, request: RequestDecode | None):
    """The frames (PIL images) ``Cosmos3OmniPipeline`` makes of its final ``latents`` (what it
    returns with ``output_type="latent"``): the same un-normalization, ``vae.decode`` split over
    ``request`` (or on this rank alone when ``None``), the same post-processing and safety check
    (diffusers 0.42.1's step 8, "Postprocess + decode"). Collective over ``request``'s group;
    ``None`` on every rank but its writer."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosSafetyChecker

    dtype = pipe.vae.dtype
    mean = pipe._vae_latents_mean.to(device=latents.device, dtype=dtype)
    inv_std = pipe._vae_latents_inv_std.to(device=latents.device, dtype=dtype)
    z_raw = latents.to(dtype) / inv_std.view(1, -1, 1, 1, 1) + mean.view(1, -1, 1, 1, 1)
    with torch.no_grad(), one_thread_on_cpu(latents.device):
        decoded = pipe.vae.decode(z_raw).sample if request is None else request.decode(pipe.vae, z_raw)
    if decoded is None:
        return None
    video = pipe.video_processor.postprocess_video(decoded.to(latents.dtype), output_type="pil")[0]
    # a modular pipeline (the distilled roots) holds a checker only once it is enabled
    if isinstance(getattr(pipe, "safety_checker", None), CosmosSafetyChecker):
        video = pipe._apply_video_safety_check(video, output_type="pil", device=latents.device)
    return video


def decode_request(pipe, latents: torch.Tensor, request: RequestDecode | None, mode: str):
    """``--vae-tiling MODE``'s decode of one request's final latents: (the frames on the writer,
    else None; how the decode ran, in words). ``auto`` tiles when the untiled decode's forecast
    (``runtime.vae_forecast``) exceeds the device's free memory on any rank of the request;
    tiled, the tiles are split over ``request``. Collective over ``request``'s group."""
    vae, shape = pipe.vae, tuple(latents.shape)
    untiled = decode_bytes(dict(vae.config), shape, vae.dtype) if mode == "auto" else 0
    tiled = wants_tiling(mode, untiled, device_budget(latents.device))
    if request is not None:
        tiled = request.any(tiled, latents.device)
    before = vae.use_tiling  # the pipeline's own encode of the next request sees it as it was
    vae.enable_tiling() if tiled else vae.disable_tiling()
    try:
        frames, ran_tiled = decode_video(pipe, latents, request), is_tiled(vae, shape)
    finally:
        vae.use_tiling = before
    how = "tiled" if ran_tiled else "untiled"
    if how == "tiled" and request is not None:
        how += f", split over {request.size} ranks"
    if tiled and how == "untiled":
        how += f" (--vae-tiling {mode}: the latent fits one {vae.tile_sample_min_height}-pixel tile)"
    return frames, how
