"""bench.load's CUDA variant without a GPU: it says why it skips, and its one-reader
broadcast method (n), which runs on gloo too, loads the files' bytes into every rank's shard."""

from __future__ import annotations

import json

import pytest
import torch
from ranks import run_ranks
from safetensors.torch import load_file

from bench import load, peer_load, reader, setup_cost, super_dry_run
from fsdp_fp8.models import MoTConfig
from fsdp_fp8.testing.sparse_checkpoint import write_sparse_checkpoint

CONFIG = MoTConfig(
    hidden_size=96, num_layers=2, num_heads=4, head_dim=24, intermediate_size=136, vocab_size=301, latent_channels=6
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip is for machines without CUDA")
def test_the_cuda_variant_skips_with_its_reason(capsys):
    assert load.main(["--device", "cuda"]) == 0
    assert "skipped: no CUDA device" in capsys.readouterr().out


def _broadcast_load(rank: int, world: int, path: str) -> dict:
    from fsdp_fp8 import gather_state_dict

    out = load.method_n(path, None, CONFIG)
    state = gather_state_dict(out["_keep"])  # collective: every rank
    return {"read": out["bytes_read"], "state": state if rank == 0 else None}


def test_the_one_reader_broadcast_loads_the_files_on_every_rank(tmp_path):
    path = write_sparse_checkpoint(CONFIG, tmp_path / "ckpt", fill="random")
    results = run_ranks(_broadcast_load, 2, str(path), timeout=120)
    files = {}
    for f in sorted(path.glob("*.safetensors")):
        files.update(load_file(f))
    data = {k: v for k, v in files.items() if v.ndim}  # the scales load from memory
    assert results[0]["read"] == sum(v.numel() * v.element_size() for v in data.values())
    assert results[1]["read"] == 0  # one reader
    state = results[0]["state"]
    for key, value in files.items():
        assert torch.equal(state[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key


def test_the_reader_bench_runs_every_variant_on_the_same_bytes(tmp_path):
    path = write_sparse_checkpoint(CONFIG, tmp_path / "ckpt", fill="random")
    results = tmp_path / "r.jsonl"
    argv = ["--checkpoint", str(path), "--reps", "2", "--threads", "1,2", "--world", "2", "--rank", "1"]
    assert reader.main([*argv, "--results", str(results)]) == 0
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    variants = {(r["cache"], r["variant"]) for r in rows}
    for cache in ("warm", "cold"):
        assert {(cache, v) for v in ("floor", "reader x1", "reader x2")} <= variants
    assert {("-", "memcpy x1"), ("-", "memcpy x2")} <= variants
    from fsdp_fp8.format.checkpoint import open_checkpoint
    from fsdp_fp8.reading.rank_bytes import entry_rank_bytes

    ckpt = open_checkpoint(path)
    expected = sum(entry_rank_bytes(e, 2, 1) for e in ckpt.tensors.values() if e.shape)
    assert all(r["bytes"] == expected and len(r["seconds_all"]) == 2 for r in rows)


def test_the_setup_bench_times_every_phase_of_both_set_ups(tmp_path):
    results = tmp_path / "r.jsonl"
    argv = ["--preset", "tiny", "--world-size", "3", "--reps", "1", "--profile", "--dir", str(tmp_path)]
    assert setup_cost.main([*argv, "--results", str(results)]) == 0
    row = json.loads(results.read_text())
    fp8, bf16 = row["median_cpu_s"]["fp8"], row["median_cpu_s"]["bf16"]
    assert row["fp8_linears"] == 2 * 14  # per layer: 8 attention + 2 x 3 MLP linears
    assert all(fp8[p] > 0 for p in setup_cost.PHASES), fp8
    # a plain BF16 user opens, plans and swaps nothing; it builds, shards and materializes
    assert [p for p in setup_cost.PHASES if bf16[p] > 0] == ["meta build", "fully_shard", "to_empty"]
    plain = row["median_cpu_s"]["plain fp8"]  # BF16's set-up plus the cast to plain float8 parameters
    assert [p for p in setup_cost.PHASES if plain[p] > 0] == ["meta build", "swap", "fully_shard", "to_empty"]
    setup = sum(fp8[p] for p in setup_cost.SETUP)
    assert row["ratios_cpu"]["setup_ratio"] == pytest.approx(setup / (bf16["meta build"] + bf16["fully_shard"]))


def test_the_super_dry_run_loads_one_rank_from_open_to_ready(tmp_path, capsys):
    results = tmp_path / "r.jsonl"
    argv = ["--preset", "tiny", "--world-size", "3", "--rank", "1", "--load", "--dir", str(tmp_path)]
    assert super_dry_run.main([*argv, "--results", str(results)]) == 0
    out = json.loads(results.read_text())
    rank_load = out["load"]
    assert "stopped" not in rank_load
    # its rows of every tensor with a shape, once (the 0-d scales come from memory)
    assert rank_load["bytes_read"] == peer_load.rank_row_bytes(tmp_path / "tiny-sparse", 3)[1]
    phases = {"open", "meta build", "plan", "swap", "fully_shard", "to_empty (cpu)", "reads"}
    assert set(rank_load["phases_s"]) == phases and all(rank_load["phases_s"][p] > 0 for p in phases)
    assert "rank 1 of 3: open to ready" in capsys.readouterr().out
