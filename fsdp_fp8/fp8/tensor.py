"""Static per-tensor FP8 weights as TorchAO ``PrototypeFloat8Tensor``s, and the W8A8 / W8A16 math.

ModelOpt convention (FORMAT.md): the weight is stored as E4M3 codes with one F32
``weight_scale``; activations are quantized with the calibrated ``input_scale``:
``x_q = clamp(x / input_scale, -448, 448).to(e4m3)``. Scales are held as (1, 1) tensors
because TorchAO's ``from_hp(scale=...)`` requires ``scale.ndim == input.ndim`` for the
2-D activations we feed it; the checkpoint's 0-d scales are reshaped on load and back
on export.
"""

from __future__ import annotations

import torch
from torchao.float8.inference import Float8MMConfig, addmm_float8_unwrapped_inference
from torchao.prototype.quantization.float8_static_quant.prototype_float8_tensor import (
    PrototypeFloat8Tensor,
)
from torchao.quantization.granularity import PerTensor
from torchao.quantization.quant_primitives import _quantize_affine_float8
from torchao.quantization.quantize_.common import KernelPreference
from torchao.quantization.quantize_.workflows import QuantizeTensorToFloat8Kwargs

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448.0

# use_fast_accum=False: the same accumulation on every device, so CPU and GPU results
# are comparable and a sharded run is bit-identical to a single-process run.
MM_CONFIG = Float8MMConfig(use_fast_accum=False)
ACT_QUANT_KWARGS = QuantizeTensorToFloat8Kwargs(
    float8_dtype=E4M3,
    granularity=PerTensor(),
    mm_config=MM_CONFIG,
    kernel_preference=KernelPreference.TORCH,
)


def make_static_fp8_weight(
    qdata: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    compute_dtype: torch.dtype,
) -> PrototypeFloat8Tensor:
    """Wrap E4M3 codes and their two per-tensor scales; ``compute_dtype`` is the activation dtype."""
    assert qdata.dtype == E4M3, qdata.dtype
    return PrototypeFloat8Tensor(
        qdata,
        weight_scale.reshape(1, 1),
        act_quant_scale=input_scale.reshape(1, 1),
        block_size=list(qdata.shape),
        mm_config=MM_CONFIG,
        act_quant_kwargs=ACT_QUANT_KWARGS,
        kernel_preference=KernelPreference.TORCH,
        dtype=compute_dtype,
    )


def empty_static_fp8_weight(
    out_features: int, in_features: int, compute_dtype: torch.dtype, device: torch.device | str
) -> PrototypeFloat8Tensor:
    """An unfilled FP8 weight: 1 byte per element plus two F32 scales (meta by default)."""
    return make_static_fp8_weight(
        torch.empty(out_features, in_features, dtype=E4M3, device=device),
        torch.empty(1, 1, dtype=torch.float32, device=device),
        torch.empty(1, 1, dtype=torch.float32, device=device),
        compute_dtype,
    )


def is_static_fp8(t: torch.Tensor) -> bool:
    """A PrototypeFloat8Tensor with per-tensor scales (what this package creates and shards)."""
    return (
        isinstance(t, PrototypeFloat8Tensor)
        and t.scale.numel() == 1
        and t.act_quant_scale is not None
        and t.act_quant_scale.numel() == 1
    )


def rebuild(t: PrototypeFloat8Tensor, qdata: torch.Tensor, **overrides) -> PrototypeFloat8Tensor:
    """Same scales and settings, new codes (per-tensor: block_size is always the full shape)."""
    return PrototypeFloat8Tensor(
        qdata,
        overrides.get("scale", t.scale),
        act_quant_scale=overrides.get("act_quant_scale", t.act_quant_scale),
        block_size=list(qdata.shape),
        mm_config=t.mm_config,
        act_quant_kwargs=t.act_quant_kwargs,
        kernel_preference=t.kernel_preference,
        dtype=overrides.get("dtype", t.dtype),
    )


def quantize_activation(x2d: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """``clamp(x / input_scale, ±448) -> E4M3`` with TorchAO's own primitive (bit-identical to its path)."""
    return _quantize_affine_float8(x2d, input_scale.reshape(1, 1), E4M3)


def fp8_gemm(
    x_q: torch.Tensor,
    input_scale: torch.Tensor,
    weight: PrototypeFloat8Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
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
        use_fast_accum=MM_CONFIG.use_fast_accum,
    )


def dequantize(weight: PrototypeFloat8Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight.float() * weight_scale`` (FORMAT.md), rounded once to ``dtype``; a temporary."""
    return (weight.qdata.to(torch.float32) * weight.scale.reshape(())).to(dtype)
