"""The staging ring's copies into CUDA rows, on fake CUDA: what a load into an accelerator does
with each slot after its read (``StagingRing.finish``), with the slot bytes laid out from the
request's ``offset % ALIGN`` (where an O_DIRECT read of the widened span puts them) and pieces
that end a tensor and start the next, into byte views of FP8 codes and BF16 rows
(``reader._pieces``). What CUDA would refuse (a device or dtype mix, a size mismatch, a view it
cannot take) raises here. Pinning and the side stream's events need a CUDA runtime: the
ring on a real GPU is tests/gpu/test_gpu_staging.py."""

from __future__ import annotations

import torch
from fake_cuda import fake_cuda
from torch._guards import active_fake_mode

from fsdp_fp8.format.safetensors_header import TensorEntry
from fsdp_fp8.load import reader
from fsdp_fp8.reading import direct_io, read_schedule, staging


def _entry(key: str, dtype: str, shape: tuple[int, ...], begin: int) -> TensorEntry:
    size = {"F8_E4M3": 1, "BF16": 2}[dtype]
    nbytes = size * shape[0] * shape[1]
    return TensorEntry(key, "model.safetensors", None, dtype, shape, begin, begin + nbytes)


def test_slots_copy_into_cuda_rows_from_where_the_span_put_the_bytes():
    codes = _entry("up.weight", "F8_E4M3", (7, 32), 4096 * 3 + 100)  # starts 100 bytes into a page
    norm = _entry("norm.weight", "BF16", (5, 16), codes.end)  # right after: one request holds both
    ring = staging.StagingRing(512, 2, torch.device("cuda"))  # not pinned on a CPU build
    assert all(b.data_ptr() % direct_io.ALIGN == 0 and b.numel() == 512 + 2 * direct_io.ALIGN for b in ring.buffers)
    with fake_cuda():
        ring.buffers = [active_fake_mode().from_tensor(b) for b in ring.buffers]  # same layout, no bytes
        dest_codes = torch.empty((3, 32), dtype=torch.float8_e4m3fn, device="cuda")  # a rank's rows 4-6
        dest_norm = torch.empty((5, 16), dtype=torch.bfloat16, device="cuda")
        pieces = reader._pieces(codes, 4, 7, dest_codes) + reader._pieces(norm, 0, 5, dest_norm)
        assert all(p.staged and p.dest.device.type == "cuda" and p.dest.dtype == torch.uint8 for p in pieces)
        requests = read_schedule.schedule(pieces, staged_bytes=ring.slot_bytes)
        assert len(requests) == 1 and len(requests[0].pieces) == 2  # file-adjacent: one read, one slot
        (request,) = requests
        views = ring.bind(request)
        lead = request.offset % direct_io.ALIGN
        assert lead == (codes.begin + 4 * 32) % direct_io.ALIGN
        assert direct_io.span(request.offset, request.nbytes)[1] <= len(ring.landing(request))
        assert [len(v) for v in views] == [3 * 32, 5 * 16 * 2]
        ring.finish(request, ok=True)
    assert ring.copies == 2 and ring.ready()
