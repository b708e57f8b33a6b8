"""The per-forward math of a static FP8 linear, and two faster variants that are options.

Defaults (what the demo digest and every parity test use): :func:`quantize_activation` is TorchAO's
``clamp(x.float() / s, ±448) -> E4M3``; :func:`dequantize` (W8A16) rounds once to the activation
dtype, in row chunks of at most :data:`DEQUANT_CHUNK_ELEMENTS`; :func:`fp8_gemm` is
``torch._scaled_mm`` with ``use_fast_accum=False``, its operands as CUDA takes them.

:class:`KernelOptions`: ``fused=True`` compiles the same two expressions into one kernel each, the
same bits (on CUDA with inductor's IEEE-division switch, else refused). ``fast_accum=True`` lets
Hopper's tensor cores keep reduced-precision partial sums: not the same arithmetic.

Design: docs/step-policy.md, "Kernel variants (the same arithmetic unless stated)".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torchao.float8.inference import addmm_float8_unwrapped_inference
from torchao.quantization.quant_primitives import _quantize_affine_float8

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.fp8.tensor import E4M3, StaticFloat8Tensor


@dataclass(frozen=True)
class KernelOptions:
    """Which variant of the same arithmetic a ``Float8StaticLinear`` runs, chosen once when it is
    built (``LoadOptions.kernels``; as TorchAO's ``Float8LinearConfig`` is): only the per-step
    precision (``Float8StaticLinear.mode``) changes afterwards."""

    fused: bool = False  # compiled activation quantization and W8A16 dequantization: the default's bits
    fast_accum: bool = False  # torch._scaled_mm(use_fast_accum=True): faster on Hopper, not the same bits

    def __post_init__(self) -> None:
        wrong = [f"`{n}` is {v!r}" for n, v in vars(self).items() if not isinstance(v, bool)]
        if wrong:
            raise ArgumentError(f"KernelOptions: {', '.join(wrong)}; each must be True or False")


DEFAULT_KERNELS = KernelOptions()


def _quantize(x2d: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    return _quantize_affine_float8(x2d, input_scale.reshape(1, 1), E4M3)


def _dequantize(codes: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.to(torch.float32) * weight_scale.reshape(())).to(dtype)


DEQUANT_CHUNK_ELEMENTS = 1 << 22  # W8A16's F32 temporary: 4 Mi elements, 16 MiB


def _dequantize_in_chunks(codes: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``_dequantize``'s bits, a row chunk at a time: at most one chunk's F32 temporary lives.

    Per element the same three steps (E4M3 -> F32 is exact, one F32 multiply by the same 0-d
    scale, one rounding to ``dtype``), so the result is bit-identical to ``_dequantize``.
    """
    rows, cols = codes.shape
    out = torch.empty((rows, cols), dtype=dtype, device=codes.device)
    step = max(1, DEQUANT_CHUNK_ELEMENTS // max(1, cols))
    scale = weight_scale.reshape(())
    for start in range(0, rows, step):
        length = min(step, rows - start)
        # mul computes in F32 (both operands) and rounds once into the ``dtype`` output.
        torch.mul(codes.narrow(0, start, length).to(torch.float32), scale, out=out.narrow(0, start, length))
    return out


@functools.cache
def ieee_division_options() -> dict[str, bool] | None:
    """The inductor options that make a compiled ``x / y`` round as eager does on CUDA; ``None``
    when this torch has no such switch (then a compiled quantization may differ on CUDA)."""
    from torch._inductor import config

    numerics = getattr(config, "eager_numerics", None)
    if numerics is not None and hasattr(numerics, "division_rounding"):  # torch 2.13
        options = {"eager_numerics.division_rounding": True}
        if hasattr(numerics, "disable_ftz"):
            options["eager_numerics.disable_ftz"] = True
        return options
    if hasattr(config, "emulate_divison_rounding"):  # the switch's first name (sic), before eager_numerics
        return {"emulate_divison_rounding": True}
    return None


@functools.cache
def _fused(fn):
    """``fn`` compiled once per process; ``dynamic=True`` so token counts do not recompile it.

    With the IEEE-division switch when the torch has one: it changes Triton's code only (the CPU
    code inductor writes divides exactly either way)."""
    return torch.compile(fn, fullgraph=True, dynamic=True, options=ieee_division_options() or {})


def _check_fused_device(t: torch.Tensor) -> None:
    if t.device.type == "cuda" and ieee_division_options() is None:
        raise RuntimeError(
            f"fused FP8 kernels on CUDA need inductor's IEEE-division switch, which torch {torch.__version__} "
            "lacks: compiled, x / input_scale could round an E4M3 code differently from eager; run with "
            "fused=False (the default)"
        )


def quantize_activation(x2d: torch.Tensor, input_scale: torch.Tensor, *, fused: bool = False) -> torch.Tensor:
    """``clamp(x / input_scale, ±448) -> E4M3`` with TorchAO's own primitive (bit-identical to its path)."""
    if fused:
        _check_fused_device(x2d)
        # Few graphs: dynamo guards on an input's strides and, for a view, on its base's sizes,
        # so every layout a model hands its linears (transposed, channels-last, sliced, a 3-D
        # input's 2-D view) would otherwise be one more recompile of the one shared function,
        # until fullgraph=True fails at the recompile limit (8). Contiguous (a copy of the
        # input only where the codes would need one anyway) and detached (no view base: free).
        if not x2d.is_contiguous():
            x2d = x2d.clone(memory_format=torch.contiguous_format)
        return _fused(_quantize)(x2d.detach(), input_scale.detach())
    return _quantize(x2d, input_scale)


def dequantize(weight: StaticFloat8Tensor, dtype: torch.dtype, *, fused: bool = False) -> torch.Tensor:
    """``weight.float() * weight_scale`` (docs/checkpoint-format.md), rounded once to ``dtype``; a temporary
    in ``dtype`` (compiled: one kernel; eagerly: row chunks, ``DEQUANT_CHUNK_ELEMENTS``)."""
    if fused:
        _check_fused_device(weight.qdata)
        # Detached: FSDP2's gathered codes are a view of the all-gather buffer (see above).
        return _fused(_dequantize)(weight.qdata.detach(), weight.scale.detach(), dtype)
    return _dequantize_in_chunks(weight.qdata, weight.scale, dtype)


def row_major(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` as CUDA's ``_scaled_mm`` takes a first operand: unit column stride and a larger
    row stride (torch's meta kernel: ``stride[0] > stride[1] and stride[1] == 1``); ``codes``
    itself when it already is (the usual case: free), else a contiguous copy. A transposed input
    or a channels-last one flattened with ``permute(0, 2, 3, 1).reshape(B, H*W, C)`` hands its
    layout on to the codes (an elementwise op keeps its input's strides); a (1, K) view may even
    have row stride 1, which ``is_contiguous`` accepts and ``_scaled_mm`` does not."""
    if codes.stride(-1) == 1 and codes.stride(0) >= max(2, codes.shape[-1]):
        return codes
    return codes.clone(memory_format=torch.contiguous_format)


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
    if bias is not None and bias.dtype != out_dtype:
        # CUDA's _scaled_mm: "Bias must be Float16 to compute Half output" (and BFloat16 for
        # BFloat16); the CPU kernel takes any. Activations in another half dtype than the
        # module's compute dtype meet a bias in the compute dtype here.
        bias = bias.to(out_dtype)
    return addmm_float8_unwrapped_inference(
        row_major(x_q),
        input_scale.reshape(1, 1),
        row_major(weight.qdata).t(),  # column-major view of the row-major (out, in) codes, as _scaled_mm wants
        weight.scale.reshape(1, 1),
        output_dtype=out_dtype,
        bias=bias,
        use_fast_accum=fast_accum,
    )
