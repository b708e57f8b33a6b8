"""Section ``gemm``: ms and TFLOP/s of each FP8 linear mode (BF16, W8A8, W8A8 fast accumulation,
W8A8 fused quantization, W8A16, W8A16 fused) at the 64B model's shapes, each one's relative error
against fp32 as a figure; on fake CUDA every input layout at the smallest shapes CUDA takes. The
FP8 linear and the modes are shared with ``step``."""

from __future__ import annotations

import statistics

from bench.gpu_smoke.context import Context
from bench.gpu_smoke.preflight import compiler_problems

# The 64B model's projection shapes (M tokens, K in, N out): attention (5120 -> 5120) and the
# MLP's up (5120 -> 20480) and down (20480 -> 5120), 4096 latent tokens.
GEMM_SHAPES = [(4096, 5120, 5120), (4096, 5120, 20480), (4096, 20480, 5120)]
DRY_GEMM_SHAPES = [(77, 64, 96)]
# Under fake CUDA nothing is timed: every input layout a linear meets, at the smallest shapes
# CUDA takes (K and N multiples of 16), is run once per mode instead.
FAKE_GEMM_ROWS = (0, 1, 7, 16, 77)
FAKE_GEMM_IN, FAKE_GEMM_OUT = 64, 96
MODES = {  # variant -> (Float8StaticLinear.mode, fused, fast_accum); None: the BF16 nn.Linear
    "BF16": None,
    "W8A8": ("native", False, False),
    "W8A8 fast accum": ("native", False, True),
    "W8A8 fused quant": ("native", True, False),
    "W8A16": ("a16", False, False),
    "W8A16 fused": ("a16", True, False),
}
FAKE_REFUSES_COMPILE = (
    "torch.compile for CUDA cannot be faked on a CPU build: inductor generates triton kernels, "
    "which need triton and a device"
)


def fp8_linear(weight, bias, dtype):
    """A Float8StaticLinear holding ``weight`` quantized per tensor, as ModelOpt would: both
    scales are made on the codes' device (a CPU scale beside CUDA codes is a device mix)."""
    import torch
    from torch import nn

    from fsdp_fp8 import Float8StaticLinear
    from fsdp_fp8.fp8.tensor import E4M3_MAX, make_static_fp8_weight

    out_f, in_f = weight.shape
    scale = weight.float().abs().amax().clamp(min=1e-12) / E4M3_MAX
    codes = (weight.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    input_scale = torch.full((), 4.0 / E4M3_MAX, dtype=torch.float32, device=codes.device)
    lin = Float8StaticLinear(in_f, out_f, bias is not None, dtype, device=weight.device)
    fp8 = make_static_fp8_weight(codes, scale.reshape(()), input_scale, dtype)
    lin.weight = nn.Parameter(fp8, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return lin.eval()


def fused_problems(ctx: Context) -> str | None:
    """Why the fused (compiled) variants cannot run here (None: they can)."""
    if ctx.fake:
        return FAKE_REFUSES_COMPILE
    problems = compiler_problems()
    return f"preflight: {'; '.join(problems)}" if problems else None


def set_mode(module, spec) -> None:
    from fsdp_fp8 import Float8StaticLinear
    from fsdp_fp8.fp8.kernels import KernelOptions

    mode, fused, fast_accum = spec
    for m in module.modules():  # a bench's switch between variants; a load fixes them (LoadOptions.kernels)
        if isinstance(m, Float8StaticLinear):
            m.mode, m.kernels = mode, KernelOptions(fused=bool(fused), fast_accum=bool(fast_accum))


def section_gemm(ctx: Context) -> None:
    import torch
    from torch import nn

    dtype = torch.bfloat16
    if ctx.fake:
        shapes = [(rows, FAKE_GEMM_IN, FAKE_GEMM_OUT) for rows in FAKE_GEMM_ROWS]
        inputs = [lambda m, k: (m, k), lambda m, k: (1, m, k), lambda m, k: (2, 1, m, k)]
    else:
        shapes = DRY_GEMM_SHAPES if ctx.dry else GEMM_SHAPES
        inputs = [lambda m, k: (m, k)]
    reps = 0 if ctx.fake else (2 if ctx.dry else (10 if ctx.quick else 50))
    unfused = fused_problems(ctx)
    for m, k, n in shapes:
        gen = torch.Generator().manual_seed(m * 31 + k + n)
        weight = ctx.place((torch.randn(n, k, generator=gen) / k**0.5).to(dtype))
        bias = ctx.place((0.1 * torch.randn(n, generator=gen)).to(dtype))
        bf16 = nn.Linear(k, n, dtype=dtype, device="meta")
        bf16.weight, bf16.bias = nn.Parameter(weight, requires_grad=False), nn.Parameter(bias, requires_grad=False)
        fp8 = fp8_linear(weight, bias, dtype)
        for shape_of in inputs:
            x = ctx.place(torch.randn(shape_of(m, k), generator=gen).to(dtype))
            ref = None
            for name, spec in MODES.items():
                variant = f"{name} x{tuple(x.shape)}->{n}"
                if spec is not None and spec[1] and unfused:
                    ctx.skip(variant, unfused)
                    continue
                with ctx.variant(variant) as r, torch.no_grad():
                    layer = bf16 if spec is None else fp8
                    if spec is not None:
                        set_mode(fp8, spec)
                    y = layer(x)
                    r.update(out_shape=list(y.shape), out_device=str(y.device), out_dtype=str(y.dtype))
                    if ctx.fake:
                        continue
                    if ref is None:  # fp32 of the same values: what every mode approximates
                        ref = x.float().reshape(-1, k) @ weight.float().t() + bias.float()
                    r["rel_err_vs_fp32"] = float((y.float().reshape(ref.shape) - ref).norm() / ref.norm())
                    samples = ctx.timed(lambda: layer(x), reps)
                    t = statistics.median(samples)
                    r.update(median_ms=round(t * 1e3, 4), tflops=round(2 * m * k * n / t / 1e12, 2))
