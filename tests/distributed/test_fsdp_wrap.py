"""Which modules get their own fully_shard: outermost blocks only."""

from __future__ import annotations

import torch
from ranks import run_ranks
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_fp8.load.fsdp_wrap import blocks


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])  # a list inside a block

    def forward(self, x):
        return self.attn(x) + sum(e(x) for e in self.experts)


class _Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_blocks_are_the_outermost_repeated_modules():
    model = _Nested()
    assert blocks(model) == list(model.layers)


def test_hugging_face_no_split_modules_name_the_blocks():
    model = _Nested()
    model._no_split_modules = ["_Layer"]
    assert blocks(model) == list(model.layers)


def _shard_nested(rank, world):
    from fsdp_fp8.load.fsdp_wrap import default_mesh, shard_model

    torch.manual_seed(0)
    model = _Nested()
    x = torch.randn(3, 4)
    expected = model(x)
    shard_model(model, default_mesh("cpu"))
    same = torch.equal(model(x), expected)
    # After a forward each block has freed its gathered weights (only its shards are held);
    # the root keeps its own gathered (FSDP2's default for the root).
    blocks_sharded = [isinstance(p, DTensor) for layer in model.layers for p in layer.parameters()]
    root_gathered = [not isinstance(p, DTensor) for p in model.head.parameters()]
    return same, all(blocks_sharded), all(root_gathered)


def test_a_model_with_nested_module_lists_shards_and_runs():
    assert run_ranks(_shard_nested, 2, timeout=120) == [(True, True, True)] * 2


def _load_with_fsdp_options(rank, world, path):
    from small_models import uneven_model_fn
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    from fsdp_fp8 import load_model

    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    plain = load_model(uneven_model_fn, path, device=torch.device("cpu"))
    expected = plain.model(x)
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=False)  # pinning needs a CUDA build
    loaded = load_model(
        uneven_model_fn,
        path,
        device=torch.device("cpu"),
        mp_policy=mp,
        offload_policy=offload,
        reshard_after_forward=False,
    )
    groups = [m._get_fsdp_state()._fsdp_param_group for m in loaded.model.modules() if hasattr(m, "_get_fsdp_state")]
    groups = [g for g in groups if g is not None]
    got = loaded.model(x)
    return {
        "same": torch.equal(got, expected),
        "policies": all(g.mp_policy is mp and g.offload_policy is offload for g in groups),
        "blocks_keep_gathered": all(g.post_forward_mesh_info is None for g in groups),
        "units": len(groups),
        "bytes_read": (loaded.report.bytes_read, plain.report.bytes_read),
    }


def test_load_model_passes_fully_shard_options_and_loads_under_cpu_offload(tmp_path):
    from small_models import write_uneven_checkpoint

    path = write_uneven_checkpoint(tmp_path / "ckpt")
    for r in run_ranks(_load_with_fsdp_options, 2, str(path), timeout=180):
        assert r["same"]  # bit-identical to the load without the options
        assert r["policies"] and r["blocks_keep_gathered"] and r["units"] > 1
        assert r["bytes_read"][0] == r["bytes_read"][1]  # the same rows, read straight into host shards
