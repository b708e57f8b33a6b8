"""Every FP8 linear mode and kernel option on fake CUDA, for weights made by every public path.

Each test runs one (weight source, kernel) pair over every input layout real models hand a
linear (2-D, 3-D, 4-D, channels-last flattened with B = 1, transposed, sliced, zero rows),
activation dtype and compute dtype (bf16, fp16) and bias, and reports every case that fails at
once. CUDA's rules come from torch's meta kernels (tests/fake_cuda.py); a case fails when
``_scaled_mm`` would refuse it on a GPU (layouts, devices, dtypes) or the output is wrong in
shape, dtype or device.

Weight sources: the loader (``Float8StaticLinear`` built on the device, as ``swap`` + ``materialize``
build it: ``to_empty`` itself cannot be faked), ``make_static_fp8_weight``, the export path
(``quantize_weight`` of a CUDA weight), and runtime PTQ (TorchAO's ``Float8Tensor``, what
``quantize_model`` builds). The fused kernels are traced by dynamo with ``aot_eager``: inductor's
CUDA code generation cannot run on a CPU build (tests/gpu/test_gpu_kernels.py checks its bits).
"""

from __future__ import annotations

import pytest
import torch
from fake_cuda import CudaRules, fake_cuda, fused_traced_not_generated, on_fake_cuda
from torch import nn

from fsdp_fp8.export.modelopt import quantize_weight
from fsdp_fp8.fp8 import kernels
from fsdp_fp8.fp8.kernels import KernelOptions
from fsdp_fp8.fp8.linear import Float8StaticLinear
from fsdp_fp8.fp8.tensor import E4M3, make_static_fp8_weight

K, N = 64, 48
DTYPES = (torch.bfloat16, torch.float16)
KERNELS = {
    "w8a8": ("native", False, False),
    "w8a8-fused": ("native", True, False),
    "w8a8-fast-accum": ("native", False, True),
    "w8a16": ("a16", False, False),
    "w8a16-fused": ("a16", True, False),
}


def _layouts(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Inputs of K features as models make them (inside ``fake_cuda()``)."""

    def empty(*size):
        return torch.empty(*size, dtype=dtype, device="cuda")

    return {
        "2-D": empty(5, K),
        "3-D": empty(2, 5, K),
        "4-D": empty(2, 3, 4, K),
        # permute(0, 2, 3, 1).reshape(B, H*W, C) of an NCHW tensor is a view when B = 1:
        # the flattened tokens have stride (1, H*W), column-major.
        "channels-last flattened": empty(1, K, 3, 4).permute(0, 2, 3, 1).reshape(1, 12, K),
        "channels-last one pixel": empty(1, K, 1, 1).permute(0, 2, 3, 1).reshape(1, 1, K),  # stride (1, 1)
        "transposed": empty(K, 5).t(),
        # (Python indexing cannot be faked on a CPU build: narrow / select are the same views.)
        "sliced columns": empty(5, K + 32).narrow(1, 16, K),
        "every other row": empty(5, 2, K).select(1, 0),
        "zero rows": empty(0, K),
        "zero rows 3-D": empty(2, 0, K),
    }


def _loader(bias: bool, compute: torch.dtype) -> nn.Module:
    return Float8StaticLinear(K, N, bias, compute, device="cuda")


def _with_weight(weight, bias: bool, compute: torch.dtype) -> nn.Module:
    lin = Float8StaticLinear(K, N, bias, compute, device="cuda")
    lin.weight = nn.Parameter(weight, requires_grad=False)
    return lin


def _made(bias: bool, compute: torch.dtype) -> nn.Module:
    codes = torch.empty(N, K, dtype=E4M3, device="cuda")
    scales = torch.empty((), device="cuda"), torch.empty((), device="cuda")
    return _with_weight(make_static_fp8_weight(codes, *scales, compute), bias, compute)


def _exported(bias: bool, compute: torch.dtype) -> nn.Module:
    codes, weight_scale = quantize_weight(torch.empty(N, K, dtype=compute, device="cuda"))
    input_scale = torch.empty((), device="cuda")
    return _with_weight(make_static_fp8_weight(codes, weight_scale, input_scale, compute), bias, compute)


SOURCES = {"loader": _loader, "make_static_fp8_weight": _made, "export": _exported}


def _problems(build, kernel: str | None, rules: CudaRules, layouts=None, other_dtypes=True) -> list[str]:
    """Every case of ``build``'s linear that fails; ``kernel=None``: a linear of TorchAO's (one GEMM
    each). ``other_dtypes``: activations in each half dtype, not only the compute dtype."""
    mode, fused, fast_accum = KERNELS[kernel] if kernel else ("native", None, None)
    problems = []
    for compute in DTYPES:
        for bias in (False, True):
            lin = build(bias, compute)
            if kernel:
                lin.mode, lin.kernels = mode, KernelOptions(fused=fused, fast_accum=fast_accum)
            for dtype in DTYPES if other_dtypes else (compute,):
                for layout, x in (layouts or _layouts)(dtype).items():
                    case = f"{layout} {tuple(x.shape)} stride {x.stride()}, {dtype} into {compute}, bias={bias}"
                    before = rules.scaled_mm
                    try:
                        with torch.no_grad():
                            y = lin(x)
                    except Exception as e:  # what CUDA would refuse, in any form
                        problems.append(f"{case}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                        continue
                    want = (*x.shape[:-1], N)
                    if tuple(y.shape) != want or y.dtype != dtype or y.device.type != "cuda":
                        problems.append(f"{case}: output {tuple(y.shape)} {y.dtype} {y.device}, want {want} {dtype}")
                    gemms = rules.scaled_mm - before
                    # Ours skips the GEMM for zero rows; TorchAO's per-row linear may run it empty.
                    if mode == "native" and (x.numel() or kernel) and gemms != (1 if x.numel() else 0):
                        problems.append(f"{case}: {gemms} _scaled_mm calls")
    return problems


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("source", SOURCES)
def test_every_layout_dtype_and_bias_runs_under_cudas_rules(source, kernel):
    with fake_cuda() as rules:
        if KERNELS[kernel][1]:
            with fused_traced_not_generated(kernels):
                problems = _problems(SOURCES[source], kernel, rules)
        else:
            problems = _problems(SOURCES[source], kernel, rules)
    assert not problems, f"{len(problems)} cases fail on CUDA:\n" + "\n".join(problems)


def _ptq_layouts(granularity: str):
    # TorchAO's own linear makes a column-major input row-major with Tensor.contiguous()
    # (torchao/float8/inference.py, preprocess_data) inside its __torch_function__ handler, where
    # TensorMethodsAsOps cannot reach it, so a CPU build cannot run those layouts faked.
    # TorchAO's per-tensor dynamic quantization takes amax over the input, which has no identity
    # for zero rows: a real failure on any device, left to TorchAO (quantize_model's users meet
    # it on an empty batch). Its linear also hands the bias to _scaled_mm as it is, so
    # activations in a dtype other than the model's meet CUDA's bias rule: the test feeds each
    # model its own dtype (Float8StaticLinear casts the bias).
    def layouts(dtype):
        return {
            n: x
            for n, x in _layouts(dtype).items()
            if (x.numel() or granularity == "per_row") and x.reshape(-1, K).stride(0) > x.reshape(-1, K).stride(1) == 1
        }

    return layouts


@pytest.mark.parametrize("granularity", ["per_tensor", "per_row"])
def test_runtime_ptq_weights_run_under_cudas_rules(granularity):
    from fsdp_fp8.runtime import ptq

    def build(bias, compute):
        lin = nn.Linear(K, N, bias=bias, device="meta", dtype=compute)
        weight = torch.empty(N, K, dtype=torch.bfloat16, device="cuda")  # per_row takes bf16 only
        # What quantize_model builds for a linear (quantize_ on CUDA asserts a GPU's capability first).
        lin.weight = nn.Parameter(ptq._float8_weight(weight, ptq._fp8_config(granularity)), requires_grad=False)
        if bias:
            lin.bias = nn.Parameter(torch.empty(N, dtype=compute, device="cuda"), requires_grad=False)
        return lin

    with fake_cuda() as rules:
        problems = _problems(build, None, rules, _ptq_layouts(granularity), other_dtypes=False)
    assert not problems, f"{len(problems)} cases fail on CUDA:\n" + "\n".join(problems)


def test_a_cpu_scale_next_to_cuda_codes_never_reaches_the_gemm():
    """``make_static_fp8_weight(cuda codes, torch.tensor(s), ...)``: the scales move to the codes'
    device, so nothing mixes devices. The move itself (a copy onto the fake device) cannot run on a
    CPU build, so the fake check is the forward's device rule with the scales on meta next to
    meta codes (tests/unit/test_fp8_linear.py checks the move onto another device)."""
    codes = torch.zeros(N, K, dtype=E4M3, device="meta")
    w = make_static_fp8_weight(codes, torch.tensor(0.5), torch.tensor(4.0 / 448), torch.bfloat16)
    assert {w.qdata.device, w.scale.device, w.act_quant_scale.device} == {torch.device("meta")}
    assert w.scale.dtype == w.act_quant_scale.dtype == torch.float32
    # Codes handed over transposed become row-major, so their .t() is what _scaled_mm takes.
    w = make_static_fp8_weight(codes.t().contiguous().t(), torch.tensor(0.5), torch.tensor(0.1), torch.bfloat16)
    assert w.qdata.stride() == (K, 1)
    with fake_cuda():
        lin = _with_weight(on_fake_cuda(w), False, torch.bfloat16)
        assert lin(torch.empty(3, K, dtype=torch.bfloat16, device="cuda")).shape == (3, N)


def test_fused_kernels_are_refused_on_cuda_without_the_ieee_division_switch(monkeypatch):
    monkeypatch.setattr(kernels, "ieee_division_options", lambda: None)
    with fake_cuda():
        x = torch.empty(5, K, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(RuntimeError, match="IEEE-division switch"):
            kernels.quantize_activation(x, torch.empty(1, 1, device="cuda"), fused=True)
        lin = _loader(False, torch.bfloat16)
        lin.mode, lin.kernels = "a16", KernelOptions(fused=True)
        with pytest.raises(RuntimeError, match="IEEE-division switch"):
            lin(x)


def test_this_torch_compiles_the_fused_kernels_with_ieee_division():
    from torch._inductor import config

    options = kernels.ieee_division_options()  # torch 2.13: eager_numerics.division_rounding
    assert options is not None and "eager_numerics.division_rounding" in options
    with config.patch(options):  # an unknown key would raise here, as in torch.compile(options=...)
        assert config.eager_numerics.division_rounding is True
