"""The reference MoT model under FSDP2 (gloo, CPU) samples exactly what it does unsharded.

This pins the FSDP2 contract mot.py relies on: reason/denoise/logits enter through the
root's ``__call__`` and each layer is called as ``layer(...)``, so every all-gather hook runs.
"""

from __future__ import annotations

import dataclasses

import torch
from ranks import run_ranks

from fsdp_fp8.models import PRESETS, build_model, init_weights
from fsdp_fp8.runtime.sampler import sample

TINY32 = dataclasses.replace(PRESETS["tiny"], dtype="float32")


def _run(model):
    ids = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    out = sample(model, ids, steps=3, seed=5, num_latent_tokens=4)
    with torch.no_grad():
        logits = model.logits(model.reason(ids))
    return out, logits


def _rank(rank: int, world: int):
    from torch.distributed.fsdp import fully_shard

    model = init_weights(build_model(TINY32, device="cpu"), seed=0)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    local_rows = model.layers[0].mlp.gate_proj.weight.to_local().shape[0]
    out, logits = _run(model)
    return local_rows, out, logits


def test_fully_sharded_sample_equals_unsharded():
    world = 3  # 88 intermediate rows do not divide by 3
    results = run_ranks(_rank, world, timeout=120)
    reference_out, reference_logits = _run(init_weights(build_model(TINY32, device="cpu"), seed=0))
    assert [rows for rows, _, _ in results] == [30, 30, 28]
    for _, out, logits in results:
        assert torch.equal(out, reference_out)
        assert torch.equal(logits, reference_logits)
