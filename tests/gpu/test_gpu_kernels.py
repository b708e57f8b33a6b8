"""The FP8 kernels on a real GPU: inductor's Triton code gives eager's codes, the row-chunked W8A16
its bits, a column-major activation runs through ``_scaled_mm``, and a static FP8 weight pins.

What the fake-CUDA tier (tests/unit/test_fake_cuda_*.py) cannot show: the bits of generated Triton code
(``x / s`` needs inductor's IEEE-division switch, ``fsdp_fp8.fp8.kernels.ieee_division_options``)
and page-locked memory. Skipped without CUDA or below compute capability 8.9 (no FP8).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with compute capability >= 8.9 (FP8)",
)

E4M3 = torch.float8_e4m3fn
ALL_CODES = torch.arange(256, dtype=torch.uint8).view(E4M3).reshape(16, 16)
SCALE = 0.731


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit; any NaN equals any NaN (the sign of a NaN code may differ)."""
    if a.dtype == E4M3:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
        nan = ((a & 0x7F) == 0x7F) & ((b & 0x7F) == 0x7F)
        return bool(((a == b) | nan).all())
    nan = a.isnan() & b.isnan()
    return bool(((a == b) & (a.signbit() == b.signbit()) | nan).all())


def _boundary_activations(dtype: torch.dtype) -> torch.Tensor:
    """Values whose quotient by SCALE lies within an F32 ulp of a midpoint between two E4M3 codes
    (where an approximate division flips the code), specials, and random values."""
    x = torch.randn(37, 16, generator=torch.Generator().manual_seed(3)) * 200
    codes = ALL_CODES.reshape(-1).float()
    finite = codes[codes.isfinite() & (codes > 0)].sort().values
    mid = (finite[:-1] + finite[1:]) / 2 * SCALE
    near = torch.stack([torch.nextafter(mid, mid - 1), mid, torch.nextafter(mid, mid + 1)]).reshape(-1)
    specials = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e30, -1e30, -0.0, 1e-30, 448 * SCALE])
    flat = torch.cat([x.reshape(-1), near, -near, specials])
    return torch.cat([flat, flat.new_zeros(-flat.numel() % 16)]).reshape(-1, 16).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compiled_quantization_on_cuda_gives_the_eager_codes(dtype):
    from fsdp_fp8.fp8 import kernels

    assert kernels.ieee_division_options() is not None, f"torch {torch.__version__} has no IEEE-division switch"
    x = _boundary_activations(dtype).cuda()
    scale = torch.tensor([[SCALE]], device="cuda")
    assert _same(kernels.quantize_activation(x, scale, fused=True), kernels.quantize_activation(x, scale))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [0.731, 3.3e-5, 1.7e3, 1e-40])
def test_compiled_and_chunked_dequantization_on_cuda_give_the_one_pass_bits(dtype, scale):
    from fsdp_fp8.fp8 import kernels
    from fsdp_fp8.fp8.tensor import make_static_fp8_weight

    codes = ALL_CODES.repeat(300, 1).cuda()  # 4800 rows: chunks of the default size and a short last one
    w = make_static_fp8_weight(codes, torch.tensor(scale), torch.tensor(1.0), dtype)
    one_pass = kernels._dequantize(w.qdata, w.scale, dtype)
    assert _same(kernels.dequantize(w, dtype), one_pass)
    assert _same(kernels.dequantize(w, dtype, fused=True), one_pass)


@pytest.mark.parametrize("mode", ["native", "a16"])
def test_column_major_and_other_dtype_inputs_match_the_row_major_forward(mode):
    from small_models import random_fp8_linear

    lin, g = random_fp8_linear(64, 32, "cuda")
    lin.mode = mode
    x = torch.randn(1, 64, 3, 4, generator=g).to("cuda", torch.bfloat16)
    channels_last = x.permute(0, 2, 3, 1).reshape(1, 12, 64)  # stride (768, 1, 12)
    with torch.no_grad():
        assert torch.equal(lin(channels_last), lin(channels_last.contiguous()))
        half = lin(channels_last.half())
    assert half.dtype == torch.float16 and half.shape == (1, 12, 32)


def test_a_static_fp8_weight_pins_and_moves_back_non_blocking():
    from fsdp_fp8.fp8.tensor import make_static_fp8_weight

    w = make_static_fp8_weight(ALL_CODES.clone(), torch.tensor(0.5), torch.tensor(0.25), torch.bfloat16)
    pinned = w.pin_memory()
    assert pinned.is_pinned() and all(t.is_pinned() for t in (pinned.qdata, pinned.scale, pinned.act_quant_scale))
    on_gpu = pinned.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert on_gpu.qdata.is_cuda and on_gpu.scale.is_cuda and on_gpu.act_quant_scale.is_cuda
    assert torch.equal(on_gpu.qdata.view(torch.uint8).cpu(), w.qdata.view(torch.uint8))
