"""The split VAE decode's gather on fake CUDA (tests/fake_cuda.py): a rank's decoded tiles packed
into one byte buffer for the send (contiguous ``uint8`` views of bfloat16: what NCCL's send takes,
gloo taking no bfloat16), and the writer's receive buffer viewed back into tiles, under CUDA's
rules (one device per op, no copy from the host). What cannot run on fake tensors: the
collectives (the gloo tests', tests/distributed/test_vae_decode.py: the same calls), and diffusers' decoder
and blend, which index with Python slices (fake CUDA's limit)."""

from __future__ import annotations

import pytest
import torch
from fake_cuda import fake_cuda

from fsdp_fp8.interop.vae_decode import assign_tiles, pack, packed_bytes, unpack

# Decoded tiles of a Wan 2.2-shaped VAE (12 channels before unpatchify, 5 frames), edge tiles smaller.
SHAPES = [(1, 12, 5, 32, 32), (1, 12, 5, 32, 8), (1, 12, 5, 16, 32), (1, 12, 5, 16, 8)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_a_ranks_tiles_pack_into_one_byte_buffer_and_unpack_on_the_writer(ranks, dtype):
    owned = assign_tiles([s[-1] * s[-2] for s in SHAPES], ranks)
    with fake_cuda(), torch.device("cuda"):
        for indices in owned:  # each rank's side; with 5 ranks one has no tile
            shapes = [SHAPES[i] for i in indices]
            tiles = [torch.empty(s, dtype=dtype) for s in shapes]
            sent = pack(tiles, torch.device("cuda"))
            assert sent.device.type == "cuda" and sent.dtype == torch.uint8 and sent.is_contiguous()
            assert sent.numel() == packed_bytes(shapes, dtype)
            received = torch.empty(packed_bytes(shapes, dtype), dtype=torch.uint8)  # the writer's buffer
            got = unpack(received, shapes, dtype)
            assert [(tuple(t.shape), t.dtype, t.device.type) for t in got] == [(s, dtype, "cuda") for s in shapes]
            assert all(t.is_contiguous() for t in got)


def test_unpack_gives_back_what_pack_sent():
    tiles = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(SHAPES)]
    got = unpack(pack(tiles, torch.device("cpu")).clone(), [tuple(t.shape) for t in tiles], torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(tiles, got))
