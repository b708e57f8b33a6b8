"""The static-FP8 linear on one process: shapes TorchAO fails on, W8A8 vs W8A16, sharing."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from small_models import FIXTURE, quantize_per_tensor

import fsdp_fp8.fp8.linear as fp8_linear_module
from fsdp_fp8.fp8.linear import Float8StaticLinear, SharedActivation
from fsdp_fp8.fp8.shared_inputs import share_quantized_inputs
from fsdp_fp8.fp8.tensor import E4M3, as_prototype, make_static_fp8_weight
from fsdp_fp8.reading.slice_reader import read_scale


def _linear(out_features=7, in_features=16, bias=True, seed=0, input_scale=3.0 / 448):
    g = torch.Generator().manual_seed(seed)
    hp = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    codes, scale = quantize_per_tensor(hp)
    lin = Float8StaticLinear(in_features, out_features, bias, torch.bfloat16, device="cpu")
    with torch.no_grad():
        lin.weight.qdata.copy_(codes)
        lin.weight.scale.fill_(scale)
        lin.weight.act_quant_scale.fill_(input_scale)
        if bias:
            lin.bias.copy_(0.1 * torch.randn(out_features, generator=g))
    return lin, hp


def _x(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_w8a8_is_torchaos_own_linear_bit_for_bit():
    lin, _ = _linear()
    x = _x(5, 16)
    assert torch.equal(lin(x), F.linear(x, as_prototype(lin.weight), lin.bias))


def test_f_linear_on_the_weight_itself_is_torchaos_mm_or_a_clear_refusal():
    """The weight has no __torch_function__ layer (set-up cost): without a bias F.linear reaches
    TorchAO's own mm, with one it stops at TorchAO's missing addmm, never a wrong result."""
    lin, _ = _linear()
    x = _x(5, 16)
    assert torch.equal(F.linear(x, lin.weight), F.linear(x, as_prototype(lin.weight)))
    with pytest.raises(NotImplementedError, match="addmm"):
        F.linear(x, lin.weight, lin.bias)


def test_zero_row_inputs_return_empty_outputs_where_torchao_divides_by_zero():
    lin, _ = _linear()
    with pytest.raises(ZeroDivisionError):
        F.linear(_x(0, 16), as_prototype(lin.weight), lin.bias)
    for mode in ("native", "a16"):
        lin.mode = mode
        assert lin(_x(0, 16)).shape == (0, 7)
        assert lin(_x(2, 0, 16)).shape == (2, 0, 7)


@pytest.mark.parametrize("shape", [(16,), (3, 16), (2, 3, 16), (2, 2, 3, 16)])
def test_inputs_of_any_rank_equal_the_same_tokens_as_2d(shape):
    lin, _ = _linear()
    x = _x(*shape)
    y = lin(x)
    assert y.shape == (*shape[:-1], 7)
    assert torch.equal(y.reshape(-1, 7), lin(x.reshape(-1, 16)))


def test_torchao_alone_fails_on_3d_inputs_with_a_static_scale():
    lin, _ = _linear()
    with pytest.raises(AssertionError):
        F.linear(_x(2, 3, 16), as_prototype(lin.weight), lin.bias)


def test_bias_stays_high_precision_and_is_added():
    lin, _ = _linear()
    assert lin.bias.dtype == torch.bfloat16 and lin.compute_dtype == torch.bfloat16
    x = _x(4, 16)
    with torch.no_grad():
        without = lin(x) - lin.bias
        lin.bias.zero_()
    torch.testing.assert_close(lin(x), without, atol=0.02, rtol=0.02)


def fp8_error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each E4M3 rounding is within 2**-4 relative; activation and weight both round, and
    the BF16 output rounds once more: |error| <= sum|x||w| * (2 * 2**-4) + output rounding."""
    return (x.float().abs() @ w.abs().T) * (2 * 2**-4) + 2**-7 * (x.float() @ w.T).abs() + 1e-3


def test_w8a8_matches_dequantize_then_matmul_within_fp8_tolerance():
    lin, _ = _linear()
    x = _x(8, 16) * 0.9  # inside the calibrated range (input_scale * 448 = 3)
    w = lin.weight.qdata.float() * lin.weight.scale.reshape(())
    expected = x.float() @ w.T + lin.bias.float()
    error = (lin(x).float() - expected).abs()
    assert (error <= fp8_error_bound(x, w) + 2**-7 * lin.bias.float().abs()).all()
    assert error.max() > 0  # activations really are quantized


def test_a16_dequantizes_inside_the_call_and_keeps_no_copy(monkeypatch):
    lin, _ = _linear()
    x = _x(6, 16)
    lin.mode = "a16"
    made = []
    real = fp8_linear_module.dequantize

    def spy(weight, dtype, **kwargs):
        w = real(weight, dtype, **kwargs)
        made.append(weakref.ref(w))
        return w

    monkeypatch.setattr(fp8_linear_module, "dequantize", spy)
    y = lin(x)
    w = (lin.weight.qdata.float() * lin.weight.scale.reshape(())).to(torch.bfloat16)
    assert torch.equal(y, F.linear(x, w, lin.bias))
    gc.collect()
    assert len(made) == 1 and made[0]() is None  # the dequantized weight died with the call
    assert {n: t.dtype for n, t in lin.state_dict().items()} == {"weight": torch.bfloat16, "bias": torch.bfloat16}
    lin.mode = "native"
    assert not torch.equal(lin(x), y)


def test_a16_is_closer_than_w8a8_to_the_unquantized_activation_on_a_real_layer():
    """The fixture's real ModelOpt layer: calibrated codes, weight and input scales."""
    from fsdp_fp8 import open_checkpoint
    from fsdp_fp8.reading.slice_reader import read_bytes

    entry = open_checkpoint(FIXTURE).fp8_modules["model.layers.0.mlp.down_proj"]
    out_f, in_f = entry.weight.shape
    lin = Float8StaticLinear(in_f, out_f, False, torch.bfloat16, device="cpu")
    with torch.no_grad():
        lin.weight.qdata.copy_(read_bytes(entry.weight, 0, out_f))
        lin.weight.scale.copy_(read_scale(entry.weight_scale).reshape(1, 1))
        lin.weight.act_quant_scale.copy_(read_scale(entry.input_scale).reshape(1, 1))
    amax = float(read_scale(entry.input_scale)) * 448
    x = (torch.rand(64, in_f, generator=torch.Generator().manual_seed(3)) * 2 - 1) * amax
    x = x.to(torch.bfloat16)
    reference = x.float() @ (lin.weight.qdata.float() * lin.weight.scale.reshape(())).T
    errors = {}
    for mode in ("native", "a16"):
        lin.mode = mode
        errors[mode] = (lin(x).float() - reference).abs().mean().item()
    assert errors["a16"] < errors["native"]


def _qkv(scales=(0.01, 0.01, 0.01)):
    parent = torch.nn.Module()
    for i, (name, s) in enumerate(zip(("q_proj", "k_proj", "v_proj"), scales)):
        lin, _ = _linear(out_features=8, seed=i, input_scale=s)
        setattr(parent, name, lin)
    return parent


def test_siblings_share_one_quantized_activation_by_storage_identity(monkeypatch):
    parent = _qkv()
    x = _x(5, 16)
    separate = [getattr(parent, n)(x) for n in ("q_proj", "k_proj", "v_proj")]
    shared, fallback = share_quantized_inputs(parent)
    assert shared == ["{q_proj,k_proj,v_proj}"] and fallback == []
    seen = []
    real = fp8_linear_module.fp8_gemm

    def spy(codes, *args, **kwargs):
        seen.append(codes)
        return real(codes, *args, **kwargs)

    monkeypatch.setattr(fp8_linear_module, "fp8_gemm", spy)
    together = [getattr(parent, n)(x) for n in ("q_proj", "k_proj", "v_proj")]
    assert len(seen) == 3 and seen[0].dtype == E4M3
    assert seen[0] is seen[1] is seen[2]
    assert all(torch.equal(a, b) for a, b in zip(separate, together))
    assert parent.q_proj.shared.quantizations == 1
    # A new input is quantized anew, and the group holds no activation between inputs.
    other = _x(5, 16, seed=9)
    [getattr(parent, n)(other) for n in ("q_proj", "k_proj", "v_proj")]
    assert parent.q_proj.shared.quantizations == 2 and parent.q_proj.shared._codes is None


def test_unequal_input_scales_fall_back_to_per_projection(caplog):
    parent = _qkv(scales=(0.01, 0.02, 0.01))
    shared, fallback = share_quantized_inputs(parent)
    assert shared == [] and fallback == ["{q_proj,k_proj,v_proj}"]
    assert parent.q_proj.shared is None
    assert "input scales differ" in caplog.text and "k_proj=0.02" in caplog.text


def test_an_in_place_change_invalidates_the_shared_activation():
    activation = SharedActivation(2)
    x = _x(3, 16)
    scale = torch.tensor([[0.01]])
    first = activation.quantize(x, x, scale)
    x.mul_(2)
    assert not torch.equal(activation.quantize(x, x, scale).view(torch.uint8), first.view(torch.uint8))


def test_weight_is_a_torchao_prototype_tensor_with_e4m3_codes():
    from torchao.prototype.quantization.float8_static_quant.prototype_float8_tensor import PrototypeFloat8Tensor

    lin, _ = _linear()
    w = lin.weight
    assert isinstance(w, PrototypeFloat8Tensor) and type(w).__name__ == "StaticFloat8Tensor"
    assert w.qdata.dtype == E4M3 and w.scale.dtype == torch.float32 and w.dtype == torch.bfloat16
    again = make_static_fp8_weight(w.qdata, w.scale, w.act_quant_scale, torch.bfloat16)
    assert torch.equal(F.linear(_x(2, 16), as_prototype(again)), F.linear(_x(2, 16), as_prototype(w)))


def test_precision_selector_compiles_whole_and_switches_without_a_sync():
    """fullgraph=True: a device sync (``.item()``, a scale read) would break the graph."""
    import torch._dynamo

    lin, _ = _linear()
    x = _x(4, 16)
    expected = {}
    for mode in ("native", "a16"):
        lin.mode = mode
        expected[mode] = lin(x)
    torch._dynamo.reset()
    compiled = torch.compile(lin, backend="aot_eager", fullgraph=True)
    for mode in ("native", "a16", "native"):
        lin.mode = mode
        assert torch.equal(compiled(x), expected[mode]), mode
