"""Section ``decode``: a Wan 2.2-shaped VAE at 720p, one rank's tiled decode against the split
over every GPU (``bench.vae_decode_ranks`` under torchrun); on fake CUDA the gather's packing."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from bench import harness
from bench.gpu_smoke.context import BAD_LINES, Context


def section_decode(ctx: Context) -> None:
    import torch

    if ctx.fake:
        from fsdp_fp8.interop.vae_decode import pack, packed_bytes, unpack

        with ctx.variant("gather packing") as r:  # what a rank sends and the writer views back
            shapes = [(1, 12, 65, 128, 128), (1, 12, 65, 128, 32)]
            tiles = [torch.empty(s, dtype=torch.bfloat16, device=ctx.device) for s in shapes]
            sent = pack(tiles, ctx.device)
            got = unpack(
                torch.empty(packed_bytes(shapes, torch.bfloat16), dtype=torch.uint8, device=ctx.device),
                shapes,
                torch.bfloat16,
            )
            r.update(bytes=sent.numel(), shapes_back=[list(t.shape) for t in got] == [list(s) for s in shapes])
        ctx.skip("torchrun", "the decode's time and peak need real ranks (--dry: gloo on CPU)")
        return
    world = torch.cuda.device_count() if ctx.device.type == "cuda" else 2
    frames = "9" if ctx.quick else "17"
    with (
        tempfile.TemporaryDirectory(prefix="fsdp_fp8-smoke-") as tmp,
        ctx.variant(f"720p x {frames}, world {world}") as r,
    ):
        report = Path(tmp) / "decode.json"
        args = ["--report", str(report), "--frames", frames] + (["--dry"] if ctx.dry else [])
        env = dict(os.environ, OMP_NUM_THREADS="1") if ctx.dry else None
        rc, text = harness.torchrun(world, "-m", "bench.vae_decode_ranks", *args, env=env)
        r.update(exit=rc, bad_lines=[x for x in text.splitlines() if BAD_LINES.search(x)][:10])
        if rc != 0 or not report.exists():
            r.update(status="failed", tail=text[-3000:])
            return
        got = json.loads(report.read_text())
        r.update({k: got[k] for k in ("height", "width", "frames", "dtype", "backend", "world")}, ranks=got["ranks"])
        first = got["ranks"][0]
        r["split_over_tiled"] = round(first["split_seconds"] / first["tiled_seconds"], 3)
        # reported, not judged here: tests/distributed/test_vae_decode.py asserts it
        r["frames_equal"] = first.get("equal")
