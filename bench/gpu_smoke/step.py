"""Section ``step``: one layer of the 64B model (hidden 5120, 4096 latent + 256 prompt tokens),
a CFG step (2 forwards) per precision and kernel option (``gemm``'s modes)."""

from __future__ import annotations

import contextlib
import statistics

from bench.gpu_smoke.context import Context
from bench.gpu_smoke.gemm import MODES, fp8_linear, fused_problems, set_mode


def _outside_fake(ctx: Context):
    if not ctx.fake:
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def _layer_config(ctx: Context):
    import dataclasses

    from fsdp_fp8.models import PRESETS, MoTConfig

    if ctx.dry or ctx.fake:
        # tiny, with an FFN width CUDA's _scaled_mm takes (multiples of 16; tiny's is 88)
        return dataclasses.replace(PRESETS["tiny"], intermediate_size=96), 16, 8
    s = PRESETS["super"]
    cfg = MoTConfig(
        hidden_size=s.hidden_size,
        num_layers=1,
        num_heads=s.num_heads,
        head_dim=s.head_dim,
        intermediate_size=s.intermediate_size,
        vocab_size=16,
        latent_channels=16,
    )
    return cfg, 4096, 256


def _to_fp8(layer, dtype):
    """The layer with every linear of its towers swapped for a per-tensor FP8 one."""
    from torch import nn

    for module in list(layer.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, fp8_linear(child.weight.detach(), child.bias, dtype))
    return layer


def section_step(ctx: Context) -> None:
    import copy

    import torch

    from fsdp_fp8.models.mot import MoTLayer
    from fsdp_fp8.models.ops import RotaryEmbedding

    cfg, latent, prompt = _layer_config(ctx)
    dtype = torch.bfloat16
    reps = 0 if ctx.fake else (2 if ctx.dry else (5 if ctx.quick else 10))
    torch.manual_seed(0)
    # Built on the (real) meta device, then materialized on ctx's: nn.init's CUDA generator has
    # no fake, and modules made inside the fake mode hold fakes that ``.to`` cannot swap.
    with _outside_fake(ctx), torch.device("meta"):
        bf16 = MoTLayer(cfg).to(dtype).eval()
    bf16.to_empty(device=ctx.device)
    for p in bf16.parameters():
        p.requires_grad_(False)
        p.normal_(0, cfg.hidden_size**-0.5)
    fp8 = _to_fp8(copy.deepcopy(bf16), dtype)
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)  # CPU tables, placed like any input
    rope_p = tuple(ctx.place(t) for t in rope(torch.arange(prompt)))
    rope_l = tuple(ctx.place(t) for t in rope(torch.arange(prompt, prompt + latent)))
    h_prompt = ctx.place(torch.randn(1, prompt, cfg.hidden_size, dtype=dtype))
    h = ctx.place(torch.randn(1, latent, cfg.hidden_size, dtype=dtype))
    shape = {"hidden": cfg.hidden_size, "heads": cfg.num_heads, "head_dim": cfg.head_dim}
    shape.update(intermediate=cfg.intermediate_size, latent_tokens=latent, prompt_tokens=prompt)
    ctx.record("shape", "ok", **shape)
    with torch.no_grad():
        _, kv = bf16(h_prompt, rope_p, phase="reason")

    def cfg_step(layer) -> None:
        layer(h, rope_l, kv, phase="generate")
        layer(h, rope_l, None, phase="generate")

    times = {}
    unfused = fused_problems(ctx)
    for name, spec in MODES.items():
        if spec is not None and spec[1] and unfused:
            ctx.skip(name, unfused)
            continue
        layer = bf16 if spec is None else fp8
        with ctx.variant(name) as r, torch.no_grad():
            if spec is not None:
                set_mode(fp8, spec)
            if ctx.device.type == "cuda" and not ctx.fake:
                torch.cuda.reset_peak_memory_stats(ctx.device)
            if ctx.fake:
                cfg_step(layer)
                continue
            samples = ctx.timed(lambda: cfg_step(layer), reps)
            times[name] = statistics.median(samples)
            r.update(median_ms=round(times[name] * 1e3, 3), all_ms=[round(s * 1e3, 3) for s in samples])
            if "BF16" in times:
                r["vs_bf16"] = round(times[name] / times["BF16"], 3)
            if ctx.device.type == "cuda":
                r["peak_device_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
