"""Section ``attention``: one 720p-sized attention call per attention backend this GPU can run,
ms and TFLOP/s; the others skipped with the reason the launcher would give."""

from __future__ import annotations

import statistics

from bench.gpu_smoke.context import Context

# One attention call of a 720p, 189-frame Cosmos 3 pass (44,160 generation tokens), Super-sized heads:
# (rows, query heads, key/value heads, head dim); under fake CUDA (and --dry) a small one.
ATTENTION_SHAPE = (44_160, 40, 8, 128)
SMALL_ATTENTION_SHAPE = (64, 4, 2, 64)


def section_attention(ctx: Context) -> None:
    """One attention call per attention backend this device can run (diffusers' registry names,
    ``fsdp_fp8.interop.attention_backend``), timed as the processors call it; the others skipped
    with the reason ``--attention-backend`` would give."""
    import torch
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from fsdp_fp8.interop.attention_backend import backend_names, unusable_reason

    rows, heads, kv_heads, dim = SMALL_ATTENTION_SHAPE if ctx.fake or ctx.dry else ATTENTION_SHAPE
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        ctx.place(torch.randn(1, rows, h, dim, generator=gen).to(torch.bfloat16)) for h in (heads, kv_heads, kv_heads)
    )
    reps = 0 if ctx.fake else (2 if ctx.dry else (3 if ctx.quick else 10))
    for name in backend_names():
        reason = unusable_reason(name, ctx.device)
        if reason is not None:
            ctx.skip(name, reason)
            continue
        with ctx.variant(name) as r, torch.no_grad():
            call = lambda name=name: dispatch_attention_fn(q, k, v, is_causal=False, enable_gqa=True, backend=name)  # noqa: E731
            out = call()
            r.update(out_shape=list(out.shape), out_device=str(out.device), out_dtype=str(out.dtype))
            if ctx.fake:
                continue
            t = statistics.median(ctx.timed(call, reps))
            r.update(median_ms=round(t * 1e3, 3), tflops=round(4 * rows * rows * heads * dim / t / 1e12, 2))
