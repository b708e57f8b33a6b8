"""Section ``demo``: ``torchrun launch/infer.py`` at min(8, GPU count) ranks (seconds, load,
digest, watchdog/terminate lines), then once with ``--cache seacache``."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from bench import harness
from bench.gpu_smoke.context import BAD_LINES, Context


def section_demo(ctx: Context) -> None:
    import torch

    if ctx.fake:
        ctx.skip("torchrun", "a whole pipeline in subprocesses, with data-dependent indexing; --dry runs it on CPU")
        return
    args = ctx.args
    env = dict(os.environ)
    steps = ["--steps", "4" if ctx.quick else "8"]
    if ctx.dry:  # the CPU's emulated FP8 GEMM is slow: fewer steps and tokens
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        steps = ["--steps", "2", "--latent-tokens", "16"]
    default = 2 if ctx.dry else min(8, torch.cuda.device_count())
    ranks = (args.demo_ranks if args else None) or default
    with tempfile.TemporaryDirectory(prefix="fsdp_fp8-smoke-") as tmp:
        for i in range(1 if ctx.quick else 2):
            with ctx.variant(f"run {i} at {ranks} ranks") as r:
                report = Path(tmp) / "reports" / f"demo-{i}.json"  # a directory the runner must create
                t0 = time.perf_counter()
                rc, text = harness.torchrun(ranks, "launch/infer.py", *steps, "--report", str(report), env=env)
                bad = [line for line in text.splitlines() if BAD_LINES.search(line)]
                r.update(exit=rc, seconds_wall=round(time.perf_counter() - t0, 2), bad_lines=bad[:10])
                if report.exists():
                    rep = json.loads(report.read_text())
                    keep = ("world_size", "device", "fp8_linears", "load_seconds", "sample_seconds", "latent_sha256")
                    r.update({k: rep.get(k) for k in keep}, precision_trace=rep.get("precision_trace"))
                if rc != 0 or bad or not report.exists():
                    r.update(status="failed", tail=text[-3000:])
        _cached_demo(ctx, Path(tmp), ranks, steps, env)


def _cached_demo(ctx: Context, tmp: Path, ranks: int, steps: list[str], env: dict) -> None:
    """The demo again with ``--cache seacache`` (docs/usage.md, "Step caching"): its computed and
    reused steps, its denoising seconds against the uncached run 0's, and whether its latent
    differs (it should, when a step was reused). A real checkpoint's passes and PSNR: bench/cache.py."""
    with ctx.variant(f"cached at {ranks} ranks") as r:
        report = tmp / "reports" / "demo-cached.json"
        rc, text = harness.torchrun(ranks, "launch/infer.py", *steps, "--cache", "seacache", "--report",
                                    str(report), env=env)  # fmt: skip
        if rc != 0 or not report.exists():
            r.update(status="failed", exit=rc, tail=text[-3000:])
            return
        cached, plain = json.loads(report.read_text()), tmp / "reports" / "demo-0.json"
        r.update(step_cache=cached["outputs"][0].get("step_cache"), sample_seconds=cached.get("sample_seconds"))
        if plain.exists():
            plain = json.loads(plain.read_text())
            r.update(
                wall_ratio=round(cached["sample_seconds"] / plain["sample_seconds"], 3),
                latent_differs=cached["latent_sha256"] != plain["latent_sha256"],
            )
