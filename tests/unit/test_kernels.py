"""The fused kernels give the eager bits, in one kernel each; fast accumulation reaches _scaled_mm.

``torch.compile`` runs on CPU here (inductor's C++ backend), so these checks need no GPU;
the GPU figures are bench/kernels.py's.
"""

from __future__ import annotations

import re

import pytest
import torch
from small_models import random_fp8_linear
from torch._inductor.utils import run_and_get_code

from fsdp_fp8.fp8 import kernels
from fsdp_fp8.fp8.kernels import KernelOptions
from fsdp_fp8.fp8.linear import Float8StaticLinear
from fsdp_fp8.fp8.tensor import E4M3, make_static_fp8_weight

ALL_CODES = torch.arange(256, dtype=torch.uint8).view(E4M3).reshape(16, 16)  # NaN codes included


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that any NaN equals any NaN: a NaN input gives an E4M3 NaN either
    way, but eager and compiled code may differ in its sign bit (0x7f against 0xff)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == E4M3:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
        nan = ((a & 0x7F) == 0x7F) & ((b & 0x7F) == 0x7F)
        return bool(((a == b) | nan).all())
    nan = a.isnan() & b.isnan()
    return bool(((a == b) & (a.signbit() == b.signbit()) | nan).all())


def _kernels(code: list[str]) -> set[str]:
    return set().union(*(re.findall(r"\bcpp_fused_\w+", c) for c in code))


SCALE = 0.731


def _activations(dtype):
    """Random values, specials, and values whose quotient by SCALE lies within an F32 ulp of the
    midpoint between two E4M3 codes: there a change in the division (a reciprocal, another
    rounding) flips the code."""
    x = torch.randn(37, 16, generator=torch.Generator().manual_seed(3)) * 200
    x[0, :8] = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e30, -1e30, -0.0, 1e-30, 448 * SCALE])
    codes = ALL_CODES.reshape(-1).float()
    finite = codes[codes.isfinite() & (codes > 0)].sort().values
    mid = (finite[:-1] + finite[1:]) / 2 * SCALE
    near = torch.stack([torch.nextafter(mid, mid - 1), mid, torch.nextafter(mid, mid + 1)]).reshape(-1)
    flat = torch.cat([x.reshape(-1), near, -near])
    return torch.cat([flat, flat.new_zeros(-flat.numel() % 16)]).reshape(-1, 16).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_quantization_is_the_eager_result_in_one_kernel(dtype):
    x, scale = _activations(dtype), torch.tensor([[SCALE]])
    fused, code = run_and_get_code(kernels.quantize_activation, x, scale, fused=True)
    assert _same(fused, kernels.quantize_activation(x, scale))
    assert len(_kernels(code)) == 1, code
    other = _activations(dtype)[:5]  # another token count: the same compiled kernel
    assert _same(kernels.quantize_activation(other, scale, fused=True), kernels.quantize_activation(other, scale))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale", [0.731, 3.3e-5, 1.7e3])
def test_fused_dequantization_is_the_eager_result_without_an_f32_buffer(dtype, scale):
    w = make_static_fp8_weight(ALL_CODES, torch.tensor(scale), torch.tensor(1.0), dtype)
    fused, code = run_and_get_code(kernels.dequantize, w, dtype, fused=True)
    assert _same(fused, kernels.dequantize(w, dtype))
    assert len(_kernels(code)) == 1
    if dtype != torch.float32:  # the only buffer is the output, in the activation dtype
        assert not re.search(r"empty_strided\w*\([^)]*torch\.float32", "\n".join(code))


@pytest.mark.parametrize("mode", ["native", "a16"])
def test_a_fused_linear_gives_the_default_bits(mode):
    lin, g = random_fp8_linear(16, 7, "cpu")
    fused, _ = random_fp8_linear(16, 7, "cpu", kernels=KernelOptions(fused=True))  # the same codes (same seed)
    lin.mode = fused.mode = mode
    x = torch.randn(2, 5, 16, generator=g).to(torch.bfloat16)
    assert "fused" in repr(fused)
    assert torch.equal(fused(x), lin(x))


def test_fast_accumulation_reaches_scaled_mm(monkeypatch):
    seen = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        seen.append(kwargs.get("use_fast_accum"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    x = torch.ones(3, 16, dtype=torch.bfloat16)
    for fast_accum in (False, True, False):
        lin = Float8StaticLinear(
            16, 7, False, torch.bfloat16, device="cpu", kernels=KernelOptions(fast_accum=fast_accum)
        )
        with torch.no_grad():
            lin.weight.qdata.zero_()
            lin.weight.scale.fill_(1.0)
            lin.weight.act_quant_scale.fill_(1.0)
        lin(x)
    assert seen == [False, True, False]


def test_kernel_options_refuse_what_is_not_a_bool():
    with pytest.raises(ValueError, match="`fused` is 1.*`fast_accum` is 'yes'"):
        KernelOptions(fused=1, fast_accum="yes")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale", [0.731, 3.3e-5, 1.7e3])
def test_eager_dequantization_in_row_chunks_gives_the_one_pass_bits(monkeypatch, dtype, scale):
    monkeypatch.setattr(kernels, "DEQUANT_CHUNK_ELEMENTS", 3 * 16)  # 16 rows in chunks of 3, the last of 1
    codes, s = ALL_CODES, torch.tensor([[scale]])
    assert _same(kernels._dequantize_in_chunks(codes, s, dtype), kernels._dequantize(codes, s, dtype))


class _LargestFloat32(torch.utils._python_dispatch.TorchDispatchMode):
    """The largest F32 tensor any op returns while active (elements)."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_w8a16_holds_no_full_size_f32_copy_of_the_weight():
    """The transient of an eager W8A16 forward is bounded by the 4 Mi-element (16 MiB) F32 chunk
    the kernels promise, not by the weight: 2048 x 4096 here, twice the chunk."""
    rows, cols = 2048, 4096
    lin = Float8StaticLinear(cols, rows, True, torch.bfloat16, device="cpu")
    with torch.no_grad():
        lin.weight.qdata.copy_(ALL_CODES.view(torch.uint8).repeat(rows // 16, cols // 16).view(E4M3))
        lin.weight.scale.fill_(0.01)
        lin.weight.act_quant_scale.fill_(0.02)
        lin.bias.zero_()
    lin.mode = "a16"
    x = torch.ones(2, cols, dtype=torch.bfloat16)
    with _LargestFloat32() as seen, torch.no_grad():
        y = lin(x)
    assert y.shape == (2, rows) and y.dtype == torch.bfloat16
    assert 0 < seen.largest <= 4 * 2**20 < rows * cols, seen.largest
