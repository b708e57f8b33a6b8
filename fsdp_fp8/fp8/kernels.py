"""The per-forward math of a static FP8 linear, and two faster variants that are options.

Defaults (what the demo digest and every parity test are produced with):

- ``quantize_activation``: TorchAO's ``_quantize_affine_float8``, ``clamp(x.float() / s, ±448)
  -> E4M3``. Eagerly that is four kernels with F32 temporaries.
- ``dequantize`` (W8A16): ``(codes.float() * weight_scale).to(dtype)``, one rounding to the
  activation dtype, through an F32 temporary the size of the weight.
- ``fp8_gemm``: ``torch._scaled_mm`` with ``use_fast_accum=False``, TorchAO's call.

``fused=True`` compiles the same two expressions with ``torch.compile`` (inductor) into one
kernel each: the F32 values live in registers and never in memory, and the operations and
their order are unchanged, so the bits are the same (tests/test_kernels.py checks every E4M3
code, infinities, NaN and saturation on CPU, and that one kernel is generated).
``fast_accum=True`` passes ``use_fast_accum=True`` to ``torch._scaled_mm``: on Hopper the FP8
tensor cores then keep partial sums in their own reduced-precision accumulator instead of
promoting them to F32 along K; the CPU kernel has one accumulation and ignores it. Its error
against an F32 reference is measured by bench/kernels.py (docs/benchmarks.md).
"""

from __future__ import annotations

import functools

import torch
from torchao.float8.inference import addmm_float8_unwrapped_inference
from torchao.quantization.quant_primitives import _quantize_affine_float8

from fsdp_fp8.fp8.tensor import E4M3, StaticFloat8Tensor


def _quantize(x2d: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    return _quantize_affine_float8(x2d, input_scale.reshape(1, 1), E4M3)


def _dequantize(codes: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.to(torch.float32) * weight_scale.reshape(())).to(dtype)


@functools.cache
def _fused(fn):
    """``fn`` compiled once per process; ``dynamic=True`` so token counts do not recompile it."""
    return torch.compile(fn, fullgraph=True, dynamic=True)


def quantize_activation(x2d: torch.Tensor, input_scale: torch.Tensor, *, fused: bool = False) -> torch.Tensor:
    """``clamp(x / input_scale, ±448) -> E4M3`` with TorchAO's own primitive (bit-identical to its path)."""
    return (_fused(_quantize) if fused else _quantize)(x2d, input_scale)


def dequantize(weight: StaticFloat8Tensor, dtype: torch.dtype, *, fused: bool = False) -> torch.Tensor:
    """``weight.float() * weight_scale`` (docs/checkpoint-format.md), rounded once to ``dtype``; a temporary."""
    return (_fused(_dequantize) if fused else _dequantize)(weight.qdata, weight.scale, dtype)


def fp8_gemm(
    x_q: torch.Tensor,
    input_scale: torch.Tensor,
    weight: StaticFloat8Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    *,
    fast_accum: bool = False,
) -> torch.Tensor:
    """W8A8: ``(x_q * input_scale) @ (w * weight_scale).T + bias`` through ``torch._scaled_mm``.

    The same call TorchAO's ``PrototypeFloat8Tensor`` linear makes; we call it directly so
    several projections can share one quantized activation (TorchAO's path re-quantizes
    per projection and refuses an already-quantized input).
    """
    return addmm_float8_unwrapped_inference(
        x_q,
        input_scale.reshape(1, 1),
        weight.qdata.t(),  # column-major view of the row-major (out, in) codes, as _scaled_mm wants
        weight.scale.reshape(1, 1),
        output_dtype=out_dtype,
        bias=bias,
        use_fast_accum=fast_accum,
    )
