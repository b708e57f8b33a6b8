"""Fusing static-FP8 projections is refused unless it changes no weight."""

from __future__ import annotations

import pytest
import torch
from small_models import quantize_per_tensor

from fsdp_fp8.fp8.tensor import E4M3
from fsdp_fp8.fp8.topology import fuse_fp8_projections, requantize_onto, rerounded_count


def _projection(rows, seed, spread):
    hp = torch.randn(rows, 16, generator=torch.Generator().manual_seed(seed)) * spread
    return quantize_per_tensor(hp)


SMALLEST_SUBNORMAL = 2.0**-9  # E4M3: 2^(1 - 7) * 2^-3


def _codes(values) -> torch.Tensor:
    codes = torch.tensor(values, dtype=torch.float32).reshape(-1, 4).to(E4M3)
    assert codes.float().flatten().tolist() == list(values)  # every value is an exact code
    return codes


# Halving is exact for these normal codes, so re-quantizing them onto twice their scale
# moves no weight's value; each smallest subnormal halves to a tie that rounds to 0 (round
# half to even): exactly these change. The counts below follow from that, not from the code.
HALVING_EXACT = [1.0, -2.0, 448.0, 0.5, 3.0, -6.0, 0.25, 96.0]
HALVING_LOSSY = [SMALLEST_SUBNORMAL, -SMALLEST_SUBNORMAL, SMALLEST_SUBNORMAL, -SMALLEST_SUBNORMAL]


def test_fusing_projections_with_different_scales_is_refused_with_the_rerounded_count():
    big = (_codes(HALVING_LOSSY * 2), torch.tensor(2.0))  # the largest scale: its codes stay
    small = (_codes(HALVING_EXACT + HALVING_LOSSY), torch.tensor(1.0))  # 4 of 12 re-round
    assert rerounded_count([big, small]) == (4, 20)
    assert rerounded_count([small, big]) == (4, 20)
    with pytest.raises(ValueError, match=r"would re-round 4 of 20 weights \(20.0%\)") as err:
        fuse_fp8_projections([big, small], ["q_proj", "k_proj"])
    assert "stay separate" in str(err.value) and "q_proj=2, k_proj=1" in str(err.value)


def test_the_projection_with_the_largest_scale_keeps_its_codes():
    """Only the siblings with a smaller scale re-round: the largest one's codes, which any
    other shared scale would change (subnormals halve to 0, 256 doubles past 448), are
    not counted."""
    big = (_codes([SMALLEST_SUBNORMAL, -SMALLEST_SUBNORMAL, 256.0, -256.0] * 3), torch.tensor(4.0))
    small = (_codes(HALVING_EXACT), torch.tensor(2.0))  # halving onto 4.0: exact
    assert rerounded_count([small, big]) == (0, 20)

    def changed(onto: float) -> int:  # weights whose value moves, codes * scale
        again = requantize_onto(*big, torch.tensor(onto)).double() * onto
        return int((again != big[0].double() * 4.0).sum())

    assert (changed(4.0), changed(8.0), changed(2.0)) == (0, 6, 6)


def test_equal_scales_fuse_exactly():
    codes_a, scale = _projection(8, 0, 1.0)
    codes_b = torch.randn(4, 16).to(E4M3)
    fused, fused_scale = fuse_fp8_projections([(codes_a, scale), (codes_b, scale.clone())], ["gate_proj", "up_proj"])
    assert torch.equal(fused.view(torch.uint8), torch.cat([codes_a, codes_b]).view(torch.uint8))
    assert torch.equal(fused_scale, scale)


def test_the_reference_model_keeps_qkv_and_gate_up_separate():
    from fsdp_fp8.models.mot import build_model
    from fsdp_fp8.models.mot_config import PRESETS

    model = build_model(PRESETS["tiny"], device="meta")
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
        assert isinstance(getattr(attn, name), torch.nn.Linear)
    assert isinstance(mlp.gate_proj, torch.nn.Linear) and isinstance(mlp.up_proj, torch.nn.Linear)
