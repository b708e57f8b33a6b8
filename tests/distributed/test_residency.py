"""Inference residency under FSDP2 (gloo, CPU): which blocks stay gathered between forwards,
what each forward then all-gathers, and forward prefetch of the next block.

Bytes are counted at the collective FSDP2 calls (``AllGatherMeter``), per call, so each
block's all-gather is seen on its own; the policy's forecast must equal what was measured.
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch
from ranks import run_ranks

from fsdp_fp8.export.modelopt import export_fp8
from fsdp_fp8.models import PRESETS, build_model, init_weights
from fsdp_fp8.runtime.sampler import sample

# tiny's uneven sizes (88, 6, 100 rows) over 4 blocks: enough blocks for auto to stop midway.
CONFIG = dataclasses.replace(PRESETS["tiny"], num_layers=4)
FORWARDS = 4  # after the reasoner: cond, uncond, cond, uncond (two CFG steps)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = init_weights(build_model(CONFIG, device="cpu"), seed=0)

    def calibrate(m):
        ids = torch.randint(0, CONFIG.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
        sample(m, ids, steps=2, seed=0, num_latent_tokens=5)

    out = tmp_path_factory.mktemp("residency") / "ckpt"
    export_fp8(model, out, config=model.config.to_config_dict(), calibrate=calibrate)
    return out


def _forwards(model, path_policy, budget, prefetch):
    from fsdp_fp8.runtime.allgather_meter import AllGatherMeter
    from fsdp_fp8.runtime.residency import apply_residency, fsdp_blocks

    residency = apply_residency(model, path_policy, budget_bytes=budget, prefetch=prefetch)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, CONFIG.vocab_size, (1, 5), generator=gen)
    x = torch.randn(1, 7, CONFIG.latent_channels, generator=gen).to(torch.bfloat16)
    t = torch.full((1,), 0.5)
    # The reasoner's forward: when each all-gather is issued relative to each block's forward.
    events: list[str] = []
    hooks = [
        block.register_forward_pre_hook(lambda m, a, i=i: events.append(f"block{i}"))
        for i, block in enumerate(fsdp_blocks(model))
    ]
    calls, digests = [], []
    with torch.no_grad():
        with AllGatherMeter(on_call=lambda n: events.append("gather")) as first:
            state = model.reason(prompt)
        for h in hooks:
            h.remove()
        for i in range(FORWARDS):
            with AllGatherMeter() as meter:
                y = model.denoise(x, t, state if i % 2 == 0 else None)
            calls.append(meter.sizes)
            digests.append(hashlib.sha256(y.float().numpy().tobytes()).hexdigest())
    return {
        "residency": residency.as_dict(),
        "first": first.sizes,
        "calls": calls,
        "digests": digests,
        "events": events,
    }


def _scenarios(rank, world, path):
    """Every policy on a freshly loaded model; auto's budgets from what ``none`` measured."""
    from fsdp_fp8 import load_model

    def run(policy, budget=None, prefetch=True):
        model = load_model(None, path, device=torch.device("cpu")).model
        return _forwards(model, policy, budget, prefetch)

    out = {"none": run("none"), "none_no_prefetch": run("none", prefetch=False), "all": run("all")}
    per_block = out["none"]["calls"][0]
    unsharded = [world * b for b in per_block]  # what each rank holds once a block is gathered
    # Room for the first two blocks, plus the running and the prefetched block twice each.
    fits_two = sum(unsharded[:2]) + 2 * 2 * max(unsharded[2:])
    # Ranks state different budgets: every rank must keep what the smallest one allows.
    out["auto"] = run("auto", fits_two + {0: 10**9, 1: 0, 2: 10**6}[rank])
    out["auto_tighter"] = run("auto", fits_two - 1)
    out["fits_two"] = fits_two
    return out


@pytest.fixture(scope="module")
def results(checkpoint):
    return run_ranks(_scenarios, 3, checkpoint, timeout=400)


def test_none_regathers_every_block_each_forward_as_forecast(results):
    for rank in results:
        r = rank["none"]
        res = r["residency"]
        assert res["resident"] == [] and res["blocks"] == CONFIG.num_layers
        assert len(r["calls"][0]) == CONFIG.num_layers  # one all-gather per block
        for sizes in r["calls"]:
            assert sizes == r["calls"][0]  # steady state: the same all-gathers every forward
            assert sum(sizes) == res["gather_bytes_per_forward"] > 0
        assert sum(r["first"]) == res["first_forward_gather_bytes"]  # the blocks and the root
        assert len(r["first"]) == CONFIG.num_layers + 1


def test_all_gathers_each_block_once_then_nothing_and_matches_bit_for_bit(results):
    for rank in results:
        r, none = rank["all"], rank["none"]
        assert r["residency"]["resident"] == list(range(CONFIG.num_layers))
        assert r["residency"]["gather_bytes_per_forward"] == 0
        assert r["first"] == none["first"]  # the reasoner's forward gathers everything once
        assert all(sizes == [] for sizes in r["calls"]), r["calls"]  # then 0 bytes per forward
        assert r["digests"] == none["digests"]  # the same outputs, bit for bit
        assert len(set(r["digests"][::2])) == 1 and r["digests"][0] != r["digests"][1]  # cond != uncond


def test_auto_keeps_the_blocks_the_budget_allows_and_ranks_agree(results):
    for rank in results:
        r, none = rank["auto"], rank["none"]
        per_block = none["calls"][0]
        assert r["residency"]["budget_bytes"] == rank["fits_two"]  # the smallest rank's budget
        assert r["residency"]["resident"] == [0, 1]
        assert r["residency"]["resident_bytes"] + r["residency"]["reserve_bytes"] <= rank["fits_two"]
        assert all(sizes == per_block[2:] for sizes in r["calls"])  # blocks 2 and 3, every forward
        assert r["residency"]["gather_bytes_per_forward"] == sum(per_block[2:])
        assert r["digests"] == none["digests"]
        # One byte less and the second block no longer fits.
        assert rank["auto_tighter"]["residency"]["resident"] == [0]
        assert all(sizes == per_block[1:] for sizes in rank["auto_tighter"]["calls"])


def test_forward_prefetch_issues_the_next_blocks_all_gather_first(results):
    def gathers_before_each_block(events):
        out, n = [], 0
        for e in events:
            if e == "gather":
                n += 1
            else:
                out.append(n)
        return out

    for rank in results:
        # Without prefetch: the root's, then block i's own before block i runs. With it, the
        # root prefetches block 0 and block i prefetches block i + 1 before it runs.
        assert gathers_before_each_block(rank["none_no_prefetch"]["events"]) == [2, 3, 4, 5]
        assert gathers_before_each_block(rank["none"]["events"]) == [3, 4, 5, 5]
        assert rank["none_no_prefetch"]["digests"] == rank["none"]["digests"]


def _launch(rank: int, world: int, mot: str, reports: str) -> dict | None:
    """The launcher on this rank (as under torchrun), at ``--resident none`` then ``all``: rank 0's
    reports."""
    import json
    import os
    from pathlib import Path
    from unittest import mock

    from fsdp_fp8.cli.runner import main

    out = {}
    with mock.patch.dict(os.environ, {"RANK": str(rank), "WORLD_SIZE": str(world)}):
        for mode in ("none", "all"):
            report = Path(reports, "not", "yet", f"report-{mode}.json")  # the runner makes the directory
            assert main(["--checkpoint", mot, "--steps", "3", "--report", str(report), "--resident", mode]) == 0
            out[mode] = json.loads(report.read_text()) if rank == 0 else None
    return out


@pytest.mark.timeout(600)
def test_the_launcher_reports_all_gather_bytes_per_step(mot_root, tmp_path, capfd):
    # The reference MoT's launcher path reports the all-gather bytes per step (the embedded demo
    # is a diffusers pipeline).
    reports = run_ranks(_launch, 2, mot_root, str(tmp_path), timeout=300)[0]
    none, every, out = reports["none"], reports["all"], capfd.readouterr().out
    assert none["latent_sha256"] == every["latent_sha256"]
    steps = none["allgather_bytes_per_step"]
    assert len(steps) == 3 and steps[1] == steps[2] > 0  # every step re-gathers every block, twice
    assert steps[0] > steps[1]  # step 1 also ran the reasoner (and gathered the root)
    assert every["allgather_bytes_per_step"][1:] == [0, 0]
    assert every["residency"]["resident"] == list(range(every["residency"]["blocks"]))
    assert "0 B per step after" in out
