"""The real ModelOpt 0.47 export opens, classifies and plans against a Llama-shaped model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from small_models import FIXTURE, llama_on_meta

from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.load.plan import plan_load
from fsdp_fp8.reading import slice_reader

PROJ = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def test_fixture_opens_with_every_projection_fp8():
    ckpt = open_checkpoint(FIXTURE)
    config = ckpt.config
    expected = {f"model.layers.{i}.{p}" for i in range(config["num_hidden_layers"]) for p in PROJ}
    assert set(ckpt.fp8_modules) == expected
    assert ckpt.quant.is_modelopt_fp8
    assert ckpt.quant.producer == "modelopt 0.47.0"
    assert set(ckpt.quant.ignore) == {"lm_head", "model.embed_tokens"}
    assert ckpt.quant.kv_cache_quant_algo is None and ckpt.quant.step_policy is None
    assert len(ckpt.quant.spellings) == 2
    assert "lm_head.weight" in ckpt.high_precision and "model.embed_tokens.weight" in ckpt.high_precision
    assert ckpt.kv_scales == {}
    assert len(ckpt.files) == 5


def test_fixture_scales_are_looked_up_across_shards():
    ckpt = open_checkpoint(FIXTURE)
    index = json.loads((FIXTURE / "model.safetensors.index.json").read_text())["weight_map"]
    cross = [m for m in ckpt.fp8_modules.values() if m.weight.file != m.weight_scale.file]
    assert cross, "the fixture stores at least one weight apart from its scales"
    for m in ckpt.fp8_modules.values():
        for e in (m.weight, m.weight_scale, m.input_scale):
            assert e.file == index[e.key]


def test_fixture_entries_point_at_the_same_bytes_as_safetensors():
    ckpt = open_checkpoint(FIXTURE)
    for key, entry in ckpt.tensors.items():
        with safe_open(entry.path, "pt") as f:
            expected = f.get_tensor(key)
        got = slice_reader.read_bytes(entry, 0, entry.shape[0] if entry.shape else 1)
        assert got.dtype == expected.dtype
        assert torch.equal(got.view(torch.uint8).reshape(-1), expected.reshape(-1).view(torch.uint8)), key


def test_fixture_plans_against_llama():
    ckpt = open_checkpoint(FIXTURE)
    model = llama_on_meta()
    plan = plan_load(ckpt, model)
    assert {t.module for t in plan.fp8} == set(ckpt.fp8_modules)
    for t in plan.fp8:
        linear = model.get_submodule(t.module)
        assert (t.out_features, t.in_features) == (linear.out_features, linear.in_features)
        assert t.compute_dtype == torch.bfloat16
    assert {t.name for t in plan.tensors} == set(ckpt.high_precision)
    assert plan.missing == () and plan.unexpected == () and plan.skipped == ()
    assert plan.fp8_bytes == sum(m.weight.nbytes + 8 for m in ckpt.fp8_modules.values())
    assert plan.high_precision_bytes == sum(e.nbytes for e in ckpt.high_precision.values())
    total = plan.fp8_bytes + plan.high_precision_bytes
    scales = 8 * len(plan.fp8)
    assert plan.rank_bytes(1, 0) == total
    assert sum(plan.rank_bytes(3, r) for r in range(3)) == total + 2 * scales
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing was touched


def test_fixture_plan_refuses_a_float32_model():
    ckpt = open_checkpoint(FIXTURE)
    with pytest.raises(ValueError) as info:
        plan_load(ckpt, llama_on_meta(torch.float32))
    # every high-precision tensor is refused (never cast); FP8 targets just compute in float32
    assert len(info.value.problems) == len(ckpt.high_precision)
    assert any(
        p.startswith("`model.norm.weight` in model-00004-of-00005.safetensors is BF16")
        and "model `model.norm.weight` is torch.float32" in p
        for p in info.value.problems
    )
