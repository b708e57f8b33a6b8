"""Each way a load plan can be refused, and what it records when it is not."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from ckpt_writer import fp8_linear, small_tensors, write_checkpoint
from small_models import SmallModel, meta

from fsdp_fp8.errors import CheckpointError
from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.load.plan import plan_load
from fsdp_fp8.shard_rows import chunk_rows


@pytest.fixture
def ckpt(tmp_path):
    return open_checkpoint(write_checkpoint(tmp_path, small_tensors()))


def problems(fn) -> list[str]:
    with pytest.raises(CheckpointError) as info:
        fn()
    return info.value.problems


def test_small_plan(ckpt):
    plan = plan_load(ckpt, meta())
    assert [t.module for t in plan.fp8] == ["layers.0.down", "layers.0.up"]
    assert [(t.out_features, t.in_features) for t in plan.fp8] == [(16, 24), (24, 16)]
    assert [t.name for t in plan.tensors] == ["lm_head.weight", "norm.weight"]


def test_bias_of_fp8_module_is_a_high_precision_target(tmp_path):
    plan = plan_load(open_checkpoint(write_checkpoint(tmp_path, small_tensors(bias=True))), meta(bias=True))
    assert "layers.0.up.bias" in {t.name for t in plan.tensors}
    assert plan.fp8[1].entry.bias.key == "layers.0.up.bias"


def test_bias_presence_must_match(tmp_path, ckpt):
    found = problems(lambda: plan_load(ckpt, meta(bias=True)))
    assert any("`layers.0.up.weight`" in p and "has no `layers.0.up.bias`" in p for p in found)
    with_bias = open_checkpoint(write_checkpoint(tmp_path / "b", small_tensors(bias=True)))
    found = problems(lambda: plan_load(with_bias, meta()))
    assert any("has `layers.0.up.bias`" in p and "has no bias" in p for p in found)


def test_fp8_shape_mismatch_names_both_shapes(ckpt):
    model = meta()
    with torch.device("meta"):
        model.layers[0].up = nn.Linear(16, 32, bias=False, dtype=torch.bfloat16)
    found = problems(lambda: plan_load(ckpt, model))
    assert any("`layers.0.up.weight`" in p and "(24, 16)" in p and "(32, 16)" in p for p in found)


def test_fp8_target_not_a_linear(ckpt):
    model = meta()
    with torch.device("meta"):
        model.layers[0].up = nn.Conv1d(16, 24, 1, bias=False)
    found = problems(lambda: plan_load(ckpt, model))
    assert any("`layers.0.up`" in p and "Conv1d, not an nn.Linear" in p for p in found)


class Float8Stub(torch.Tensor):
    """Stands in for a torchao float8 weight: any tensor subclass means 'already quantized'."""


def test_fp8_target_already_quantized(ckpt):
    model = meta()
    up = model.layers[0].up
    up.weight = nn.Parameter(torch.empty(24, 16, dtype=torch.float8_e4m3fn, device="meta"), requires_grad=False)
    found = problems(lambda: plan_load(ckpt, model))
    assert any("`layers.0.up` is already quantized" in p for p in found)
    model = meta()
    model.layers[0].up.weight = nn.Parameter(
        torch.empty(24, 16, dtype=torch.bfloat16, device="meta").as_subclass(Float8Stub)
    )
    found = problems(lambda: plan_load(ckpt, model))
    assert any("`layers.0.up` is already quantized" in p and "Float8Stub" in p for p in found)


def test_high_precision_dtype_mismatch_is_not_cast(ckpt):
    model = meta()
    model.norm.float()
    found = problems(lambda: plan_load(ckpt, model))
    assert found == [
        "`norm.weight` in model.safetensors is BF16 (torch.bfloat16) but model `norm.weight` "
        "is torch.float32; refusing to cast silently"
    ]


def test_high_precision_shape_mismatch(ckpt):
    model = meta()
    with torch.device("meta"):
        model.lm_head = nn.Linear(16, 41, bias=False, dtype=torch.bfloat16)
    found = problems(lambda: plan_load(ckpt, model))
    assert any("`lm_head.weight`" in p and "(40, 16)" in p and "(41, 16)" in p for p in found)


class Extra(SmallModel):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.extra = nn.Linear(4, 4, bias=False)
        self.register_buffer("persist", torch.zeros(3))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


def test_missing_and_unexpected_strict_and_not(tmp_path):
    tensors = {
        **small_tensors(),
        "stray.weight": torch.zeros(2, dtype=torch.bfloat16),
        **fp8_linear("ghost.proj", 8, 8),
    }
    ckpt = open_checkpoint(write_checkpoint(tmp_path, tensors))
    found = problems(lambda: plan_load(ckpt, meta(Extra)))
    assert "model `extra.weight` is not filled by any checkpoint tensor" in found
    assert "model `persist` is not filled by any checkpoint tensor" in found
    assert not any("scratch" in p for p in found)
    assert "checkpoint tensor `stray.weight` in model.safetensors has no place in the model" in found
    assert any("`ghost.proj.weight`" in p for p in found)
    plan = plan_load(ckpt, meta(Extra), strict=False)
    assert plan.missing == ("extra.weight", "persist")
    assert plan.unexpected == ("ghost.proj.input_scale", "ghost.proj.weight", "ghost.proj.weight_scale", "stray.weight")


def test_key_map_renames_and_skips(tmp_path):
    ckpt = open_checkpoint(write_checkpoint(tmp_path, small_tensors()))

    def key_map(key):
        if key.startswith("lm_head"):
            return None
        return "body." + key

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = SmallModel()

    model = meta(Wrapped)
    plan = plan_load(ckpt, model, key_map=key_map, strict=False)
    assert [t.module for t in plan.fp8] == ["body.layers.0.down", "body.layers.0.up"]
    assert plan.skipped == ("lm_head.weight",)
    assert plan.missing == ("body.lm_head.weight",)


def test_two_keys_onto_one_target(ckpt):
    found = problems(lambda: plan_load(ckpt, meta(), key_map=lambda k: k.replace("down", "up")))
    assert any("both map to model `layers.0.up.weight`" in p for p in found)


def test_key_map_to_non_weight(ckpt):
    found = problems(lambda: plan_load(ckpt, meta(), key_map=lambda k: k + "_x" if ".up." in k else k))
    assert any("maps to `layers.0.up.weight_x`, which is not a `.weight`" in p for p in found)


def test_plan_mutates_nothing(ckpt):
    model = meta()
    before = {k: (type(v), v.dtype, v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    modules = [type(m) for m in model.modules()]
    plan_load(ckpt, model)
    assert before == {k: (type(v), v.dtype, v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    assert modules == [type(m) for m in model.modules()]


@pytest.mark.parametrize("world", [1, 2, 3, 5, 7])
def test_rank_bytes_follow_torch_chunk(ckpt, world):
    plan = plan_load(ckpt, meta())
    for rank in range(world):
        expected = 0
        for e in [t.entry for t in plan.tensors] + [t.entry.weight for t in plan.fp8]:
            rows = torch.arange(e.shape[0]).chunk(world)
            n = len(rows[rank]) if rank < len(rows) else 0
            expected += n * e.nbytes // e.shape[0]
        expected += 8 * len(plan.fp8)
        assert plan.rank_bytes(world, rank) == expected


def test_chunk_rows_matches_torch_chunk():
    for rows in range(0, 30):
        for world in range(1, 9):
            chunks = torch.arange(rows).chunk(world) if rows else ()
            for rank in range(world):
                start, stop = chunk_rows(rows, world, rank)
                got = list(range(start, stop))
                assert got == (chunks[rank].tolist() if rank < len(chunks) else []), (rows, world, rank)
    with pytest.raises(ValueError):
        chunk_rows(4, 2, 2)
