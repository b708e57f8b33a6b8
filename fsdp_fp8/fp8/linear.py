"""The static-FP8 linear: W8A8 through ``torch._scaled_mm``, or W8A16 on nominated steps.

It fills the gaps TorchAO 0.18's ``PrototypeFloat8Tensor`` linear has: a zero-row input
(TorchAO divides by the row count) returns an empty output, and inputs of any rank are
flattened to 2-D tokens first (TorchAO's (1, 1) activation scale does not broadcast
against >2-D inputs). The bias stays in high precision, cast to the activations' dtype when
they come in another one (CUDA's ``_scaled_mm`` and ``F.linear`` take the bias in the output
dtype).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.fp8.kernels import DEFAULT_KERNELS, KernelOptions, dequantize, fp8_gemm, quantize_activation
from fsdp_fp8.fp8.tensor import empty_static_fp8_weight, is_static_fp8

Mode = Literal["native", "a16"]


class SharedActivation:
    """Quantizes one input once for the projections that read it (q/k/v, gate/up).

    Valid only while every member has the same ``input_scale``; the loader checks that
    once, at load time, and never puts linears with different scales in one group (a
    scale read in forward would sync the device). Identity of the input object (and its
    version counter, so an in-place change invalidates) decides reuse.
    """

    def __init__(self, members: int):
        self.members = members
        self._source: torch.Tensor | None = None
        self._version = -1
        self._codes: torch.Tensor | None = None
        self._uses = 0
        self.quantizations = 0  # how many times this group actually quantized (for tests/bench)

    def quantize(
        self, x: torch.Tensor, x2d: torch.Tensor, input_scale: torch.Tensor, *, fused: bool = False
    ) -> torch.Tensor:
        if self._source is x and self._version == x._version and self._uses < self.members:
            codes = self._codes
        else:
            codes = quantize_activation(x2d, input_scale, fused=fused)
            self._source, self._version, self._codes, self._uses = x, x._version, codes, 0
            self.quantizations += 1
        self._uses += 1
        if self._uses >= self.members:  # last reader: drop references, keep no activation alive
            self._source = self._codes = None
        return codes


class Float8StaticLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` a ``StaticFloat8Tensor`` (per-tensor static FP8).

    ``kernels`` (``KernelOptions``) is fixed when the linear is built; ``mode`` is the one
    setting that changes afterwards, per denoising step (``fsdp_fp8.runtime.precision``), and
    ``shared`` is set once after the load (``fsdp_fp8.fp8.shared_inputs``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        compute_dtype: torch.dtype,
        device: torch.device | str = "meta",
        kernels: KernelOptions = DEFAULT_KERNELS,
    ):
        super().__init__()
        # Plain attributes go straight to __dict__ and parameters through register_parameter:
        # Module.__setattr__'s checks cost more than the rest of this constructor, and a
        # Super-scale swap builds 896 of these (bench/setup_cost.py).
        self.__dict__.update(
            in_features=in_features, out_features=out_features, compute_dtype=compute_dtype, kernels=kernels
        )
        self.mode: Mode
        self.shared: SharedActivation | None
        self.__dict__.update(mode="native", shared=None)
        weight = empty_static_fp8_weight(out_features, in_features, compute_dtype, device)
        # What nn.Parameter(weight, requires_grad=False) does to a tensor subclass (detach, then
        # flag the alias), without the detach: the fresh weight has no other holder to alias.
        weight._is_param = True
        self.register_parameter("weight", weight)
        self.register_parameter(
            "bias",
            nn.Parameter(torch.empty(out_features, dtype=compute_dtype, device=device), requires_grad=False)
            if bias
            else None,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, compute_dtype={self.compute_dtype}, mode={self.mode}"
            + (", fused" if self.kernels.fused else "")
            + (", fast_accum" if self.kernels.fast_accum else "")
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not is_static_fp8(weight):
            raise RuntimeError(
                f"{type(self).__name__} weight is {type(weight).__name__}, not an unsharded static FP8 "
                "tensor: run it inside its FSDP module, or load the model first"
            )
        if x.shape[-1] != self.in_features:
            raise ArgumentError(f"input has {x.shape[-1]} features but the linear expects {self.in_features}")
        out_shape = (*x.shape[:-1], self.out_features)
        x2d = x.reshape(-1, self.in_features)
        if x2d.shape[0] == 0:
            return x.new_empty(out_shape)
        bias, kernels = self.bias, self.kernels
        if self.mode == "a16":
            if bias is not None and bias.dtype != x.dtype:
                bias = bias.to(x.dtype)  # F.linear takes one dtype (fp8_gemm does the same for W8A8)
            y = F.linear(x2d, dequantize(weight, x.dtype, fused=kernels.fused), bias)
        else:
            input_scale = weight.act_quant_scale
            if self.shared is not None:
                codes = self.shared.quantize(x, x2d, input_scale, fused=kernels.fused)
            else:
                codes = quantize_activation(x2d, input_scale, fused=kernels.fused)
            y = fp8_gemm(codes, input_scale, weight, bias, x.dtype, fast_accum=kernels.fast_accum)
        return y.reshape(out_shape)


def cuda_shape_problems(targets) -> list[str]:
    """FP8 linears whose W8A8 GEMM cannot run on CUDA.

    ``torch._scaled_mm`` on CUDA needs the inner (``in_features``) and output
    (``out_features``) dimensions to be multiples of 16; on the CPU any shape runs. Refusing
    at load time beats a kernel error in the middle of sampling.
    """
    return [
        f"`{t.module}` is an FP8 linear of shape ({t.out_features}, {t.in_features}); torch._scaled_mm "
        "on CUDA needs both dimensions to be multiples of 16"
        for t in targets
        if t.in_features % 16 or t.out_features % 16
    ]
