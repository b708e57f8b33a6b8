"""Fusing static-FP8 projections is refused unless it changes no weight."""

from __future__ import annotations

import pytest
import torch

from fsdp_fp8.fp8.tensor import E4M3
from fsdp_fp8.fp8.topology import fuse_fp8_projections, requantize_onto, rerounded_count
from small_models import quantize_per_tensor


def _projection(rows, seed, spread):
    hp = torch.randn(rows, 16, generator=torch.Generator().manual_seed(seed)) * spread
    return quantize_per_tensor(hp)


def test_fusing_projections_with_different_scales_is_refused_with_the_rerounded_count():
    parts = [_projection(8, 0, 1.0), _projection(4, 1, 0.3), _projection(4, 2, 0.5)]
    # What re-quantizing onto the largest scale would have done, computed here directly.
    shared = max(s for _, s in parts)
    changed = 0
    for codes, scale in parts:
        again = (codes.float() * scale / shared).clamp(-448, 448).to(E4M3)
        changed += int((again.view(torch.uint8) != codes.view(torch.uint8)).sum())
    assert changed > 0
    assert rerounded_count(parts) == (changed, 256)
    with pytest.raises(ValueError, match=rf"would re-round {changed} of 256 weights") as err:
        fuse_fp8_projections(parts, ["q_proj", "k_proj", "v_proj"])
    assert "stay separate" in str(err.value)


def test_the_projection_with_the_largest_scale_keeps_its_codes():
    parts = [_projection(8, 0, 1.0), _projection(4, 1, 0.3)]
    big = max(range(2), key=lambda i: float(parts[i][1]))
    codes, scale = parts[big]
    assert torch.equal(requantize_onto(codes, scale, scale).view(torch.uint8), codes.view(torch.uint8))


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
