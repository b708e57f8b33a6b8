"""The reference MoT model under FSDP2 (gloo, CPU) samples exactly what it does unsharded.

This pins the FSDP2 contract mot.py relies on: reason/denoise/logits enter through the
root's ``__call__`` and each layer is called as ``layer(...)``, so every all-gather hook runs.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from fsdp_fp8.models import PRESETS, build_model, init_weights
from fsdp_fp8.sampler import sample

TINY32 = dataclasses.replace(PRESETS["tiny"], dtype="float32")


def _run(model):
    ids = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    out = sample(model, ids, steps=3, seed=5, num_latent_tokens=4)
    with torch.no_grad():
        logits = model.logits(model.reason(ids))
    return out, logits


def _rank(rank: int, world: int, store: str, queue) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(
        "gloo", init_method=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        model = init_weights(build_model(TINY32, device="cpu"), seed=0)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        local_rows = model.layers[0].mlp.gate_proj.weight.to_local().shape[0]
        out, logits = _run(model)
        # numpy pickles by value; a tensor would be passed as shared memory that dies with us.
        queue.put((rank, local_rows, out.numpy(), logits.numpy()))
    except BaseException:
        queue.put((rank, traceback.format_exc(), None, None))  # fail the test now, not at timeout
        raise
    finally:
        dist.destroy_process_group()


def test_fully_sharded_sample_equals_unsharded(tmp_path):
    world = 3  # 88 intermediate rows do not divide by 3
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    store = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=_rank, args=(r, world, store, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = sorted(queue.get(timeout=120) for _ in procs)
        errors = [rows for _, rows, out, _ in results if out is None]
        assert not errors, "\n".join(errors)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        for p in procs:  # never leave a hung rank behind a failed test
            if p.is_alive():
                p.kill()
    reference_out, reference_logits = _run(init_weights(build_model(TINY32, device="cpu"), seed=0))
    assert [rows for _, rows, _, _ in results] == [30, 30, 28]
    for _, _, out, logits in results:
        assert torch.equal(torch.from_numpy(out), reference_out)
        assert torch.equal(torch.from_numpy(logits), reference_logits)
