"""The FP8 linear on a real GPU: every mode against an fp32 reference over the input layouts a
model hands it, ``aten::_scaled_mm`` and a GEMM kernel in the profiler under W8A8 (none under
W8A16), and the uint8 all-gather hooks rebuilding the codes for meshes with a zero-row rank.
Skipped without CUDA or below compute capability 8.9 (no FP8 tensor cores). The same code
paths run on fake CUDA in the CPU suite (tests/distributed/test_gpu_smoke.py); this is where the values
are compared. bench.gpu_smoke runs this file in its ``tests`` section."""

from __future__ import annotations

import re

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA GPU with compute capability >= 8.9 (FP8)",
)

IN, OUT = 256, 384  # multiples of 16, as _scaled_mm on CUDA needs
ROWS = (0, 1, 7, 16, 77, 4096)
# Relative Frobenius error against the fp32 reference that rounds activations and weights
# exactly as the FP8 path does: what is left is the BF16 output rounding (2^-8 relative per
# element) and the accumulation order, far below this bound; a wrong scale or layout is O(1).
REL_TOL = 1e-2
FAST_ACCUM_REL_TOL = 2e-2
MODES = [("native", {}), ("native", {"fast_accum": True}), ("a16", {})]


def _fp8_linear(weight, bias, dtype):
    """A Float8StaticLinear holding ``weight`` quantized per tensor, scales on the codes' device."""
    from torch import nn

    from fsdp_fp8 import Float8StaticLinear
    from fsdp_fp8.fp8.tensor import E4M3_MAX, make_static_fp8_weight

    out_f, in_f = weight.shape
    scale = weight.float().abs().amax().clamp(min=1e-12) / E4M3_MAX
    codes = (weight.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    input_scale = torch.full((), 4.0 / E4M3_MAX, device=weight.device)
    lin = Float8StaticLinear(in_f, out_f, bias is not None, dtype, device=weight.device)
    lin.weight = nn.Parameter(make_static_fp8_weight(codes, scale.reshape(()), input_scale, dtype), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.to(dtype), requires_grad=False)
    return lin


def _reference(x, lin, mode: str):
    """fp32 with the FP8 path's own rounding of activations (W8A8) and weights."""
    from fsdp_fp8.fp8.kernels import quantize_activation

    w = lin.weight.qdata.float() * lin.weight.scale.float().reshape(())
    x2d = x.reshape(-1, x.shape[-1])
    if mode == "native":
        s = lin.weight.act_quant_scale.float().reshape(())
        x2d = quantize_activation(x2d, lin.weight.act_quant_scale).float() * s
    y = x2d.float() @ w.t()
    if lin.bias is not None:
        y = y + lin.bias.float()
    return y.reshape(*x.shape[:-1], w.shape[0])


@pytest.fixture(scope="module", params=[False, True], ids=["no-bias", "bias"])
def linear(request):
    gen = torch.Generator().manual_seed(0)
    device = torch.device("cuda", 0)
    w = (torch.randn(OUT, IN, generator=gen) / IN**0.5).to(device)
    b = (0.1 * torch.randn(OUT, generator=gen)).to(device) if request.param else None
    return _fp8_linear(w, b, torch.bfloat16)


@pytest.mark.parametrize("mode,options", MODES, ids=["w8a8", "w8a8-fast-accum", "w8a16"])
@pytest.mark.parametrize("rank", [2, 3, 4])
@pytest.mark.parametrize("rows", ROWS)
def test_every_fp8_gemm_matches_the_fp32_reference(linear, mode, options, rank, rows):
    shape = {2: (rows, IN), 3: (1, rows, IN), 4: (2, 1, rows, IN)}[rank]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(rows + rank)).to("cuda", torch.bfloat16)
    from fsdp_fp8.fp8.kernels import KernelOptions

    linear.mode, linear.kernels = mode, KernelOptions(**options)
    try:
        with torch.no_grad():
            y = linear(x)
    finally:
        linear.mode, linear.kernels = "native", KernelOptions()
    ref = _reference(x, linear, mode)
    assert y.shape == ref.shape and y.device.type == "cuda" and y.dtype == torch.bfloat16
    if ref.numel():
        err = float((y.float() - ref).norm() / ref.norm().clamp(min=1e-30))
        assert err <= (FAST_ACCUM_REL_TOL if options else REL_TOL), err


def test_w8a8_runs_scaled_mm_and_a_gemm_kernel_and_w8a16_does_not(linear):
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(77, IN, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    seen = {}
    for mode in ("native", "a16"):
        linear.mode = mode
        with torch.no_grad():
            linear(x)  # warm-up outside the profile
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                linear(x)
                torch.cuda.synchronize()
        events = prof.events()
        seen[mode] = (
            {e.name for e in events if e.device_type.name == "CPU"},
            {e.name for e in events if e.device_type.name == "CUDA"},
        )
    linear.mode = "native"
    ops, kernels = seen["native"]
    assert "aten::_scaled_mm" in ops
    assert [k for k in kernels if re.search(r"gemm|nvjet|xmma|cutlass|sm\d\d", k, re.I)], sorted(kernels)
    assert "aten::_scaled_mm" not in seen["a16"][0]


class _Mesh:
    def __init__(self, n: int):
        self.n = n

    def size(self, dim: int = 0) -> int:
        return self.n


@pytest.mark.parametrize(("world", "rows"), [(3, 4), (8, 7), (3, 5), (8, 17)])  # 3/4 and 8/7: zero-row ranks
def test_the_uint8_hooks_rebuild_the_codes_on_the_gpu(world, rows):
    from fsdp_fp8.fp8.tensor import E4M3, make_static_fp8_weight, rebuild

    device = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(world * 100 + rows)
    full_codes = (torch.randn(rows, 48, generator=gen) * 50).clamp(-448, 448).to(E4M3).to(device)
    full = make_static_fp8_weight(
        full_codes, torch.tensor(0.01, device=device), torch.tensor(0.02, device=device), torch.bfloat16
    )
    pad = -(-rows // world)
    chunks = list(torch.chunk(full_codes, world))
    chunks += [full_codes[:0]] * (world - len(chunks))  # torch.chunk yields fewer pieces
    payloads = []
    for codes in chunks:
        local = rebuild(full, codes.contiguous())
        (payload,), meta = local.fsdp_pre_all_gather(_Mesh(world), full.shape, full.stride(), None, None)
        assert payload.dtype == torch.uint8 and payload.is_cuda and tuple(payload.shape) == (pad, 48)
        payloads.append(payload)
    unsharded, _ = local.fsdp_post_all_gather((torch.cat(payloads),), meta, torch.bfloat16)
    assert torch.equal(unsharded.qdata.view(torch.uint8), full_codes.view(torch.uint8))
    # out=: FSDP2's buffer reuse after the first all-gather
    local.fsdp_post_all_gather((torch.cat(payloads),), meta, torch.bfloat16, out=unsharded)
    assert torch.equal(unsharded.qdata.view(torch.uint8), full_codes.view(torch.uint8))
