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
