"""The decoded frames do not depend on the intra-op thread count on CPU (issue 45): a one-rank run
uses every core, torchrun's ranks one thread each, and oneDNN's convolutions round by how their
work is split over threads. ``decode_video`` decodes on one thread, so the frames of one latent are
the same bytes at 1 and 2 threads, tiled (what ``--vae-tiling on`` splits over ranks) and not."""

from __future__ import annotations

import hashlib

import pytest
import torch

pytest.importorskip("diffusers")
pytestmark = pytest.mark.timeout(300)


def _frames_digest(pipe, latents, threads: int) -> tuple[str, int]:
    from fsdp_fp8.interop.vae_decode import decode_video

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        video = decode_video(pipe, latents, None)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    return hashlib.sha256(b"".join(frame.tobytes() for frame in video)).hexdigest(), after


@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "untiled"])
def test_frames_are_the_same_bytes_at_one_and_two_threads(demo_root, tiled):
    from fsdp_fp8 import load_pipeline

    pipe = load_pipeline(str(demo_root), device=torch.device("cpu"))
    pipe.vae.enable_tiling() if tiled else pipe.vae.disable_tiling()
    # A 288 x 288 frame's latent (72 x 72): four of diffusers' default tiles when tiled.
    latents = torch.randn(1, pipe.vae.config.z_dim, 1, 72, 72, generator=torch.Generator().manual_seed(0))
    one, after_one = _frames_digest(pipe, latents, 1)
    two, after_two = _frames_digest(pipe, latents, 2)
    assert one == two
    assert (after_one, after_two) == (1, 2)  # the caller's thread count is put back
