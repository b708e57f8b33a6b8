"""Super scale without the weights: a sparse ~63B-parameter checkpoint is opened, planned on
meta and inspected, and the per-rank forecast matches a hand computation; a small model of
the same structure loads for real on 4 ranks and reads exactly what was forecast."""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks
from small_models import load_files

from fsdp_fp8.cli import commands as cli
from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.load.plan import plan_load
from fsdp_fp8.models import PRESETS, MoTConfig, build_model
from fsdp_fp8.reading.read_options import ReadOptions
from fsdp_fp8.testing.sparse_checkpoint import write_sparse_checkpoint

MiB = 1 << 20
# The Super's structure at toy size: rows that 4 ranks split unevenly (vocab 1001, latent 6:
# one rank gets no row of proj_out), head_dim 20, two layers.
SMALL = MoTConfig(
    hidden_size=80,
    num_layers=2,
    num_heads=4,
    head_dim=20,
    intermediate_size=200,
    vocab_size=1001,
    latent_channels=6,
    rope_theta=1000000.0,
)


@pytest.fixture(scope="module")
def super_dir(tmp_path_factory):
    return write_sparse_checkpoint(PRESETS["super"], tmp_path_factory.mktemp("super") / "ckpt")


def test_super_checkpoint_is_sparse_and_complete(super_dir):
    files = list(super_dir.iterdir())
    apparent = sum(f.stat().st_size for f in files)
    on_disk = sum(f.stat().st_blocks * 512 for f in files)
    assert apparent > 60e9
    assert on_disk < 64 * MiB  # headers and scales only
    ckpt = open_checkpoint(super_dir)
    assert len(ckpt.fp8_modules) == 64 * 14  # per layer: 8 attention + 2 x 3 MLP linears
    assert len(ckpt.tensors) > 3000


def _hand_forecast_super(world: int) -> tuple[int, int]:
    """(FP8 bytes, high-precision bytes) per rank for PRESETS["super"], by hand.

    Every row count of the Super (5120, 8192, 20480, 151936, 128, 64, 256...) divides by 8,
    so each rank reads exactly 1/8 of every tensor, plus all 0-d scales.
    """
    h, layers, inner, inter, vocab, latent, freq, head = 5120, 64, 64 * 128, 20480, 151936, 64, 256, 128
    fp8_per_layer = 8 * inner * h + 6 * inter * h  # 1 byte per element
    scales = layers * 14 * 2 * 4
    bf16 = 2 * (
        2 * vocab * h  # embed_tokens, lm_head
        + h * latent
        + h
        + latent * h
        + latent  # proj_in, proj_out (+ biases)
        + h * freq
        + h
        + h * h
        + h  # time_embedder.linear_1 / linear_2 (+ biases)
        + 2 * h  # norm, norm_moe_gen
        + layers
        * (
            3 * inner
            + h  # add_q/k/v_proj and to_add_out biases
            + 4 * head  # norm_q, norm_k, norm_added_q, norm_added_k
            + 4 * h
        )  # the four layer norms
    )
    return layers * fp8_per_layer // world + scales, bf16 // world


def test_super_plan_on_meta_and_forecast_match_hand_computation(super_dir):
    ckpt = open_checkpoint(super_dir)
    model = build_model(MoTConfig.from_config_dict(ckpt.config), device="meta")
    plan = plan_load(ckpt, model)
    assert len(plan.fp8) == 896 and not plan.missing and not plan.unexpected
    fp8, high = _hand_forecast_super(8)
    for rank in range(8):
        f = plan.forecast(8, rank, staging_bytes=64 * MiB)
        assert (f.fp8_bytes, f.high_precision_bytes) == (fp8, high)
        assert f.read_bytes == plan.rank_bytes(8, rank) == fp8 + high
        assert f.held_bytes == fp8 + high  # nothing to pad at 8 ranks
        # Into an accelerator every read is staged through one host ring: 4 slots of 16 MiB,
        # the whole budget (each rank stages GBs); a budget above what the rank reads (its rows
        # but the 1,792 scales, which load from memory) shrinks to 4 slots that just hold that.
        assert f.staging_peak_bytes == 64 * MiB
        staged = fp8 + high - 4 * 1792
        assert staged <= plan.forecast(8, rank, staging_bytes=1 << 40).staging_peak_bytes < staged + 4


def test_inspect_super_for_8_ranks(super_dir, capsys):
    assert cli.main(["inspect", str(super_dir), "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    fp8, high = _hand_forecast_super(8)
    assert "FP8 linears:     896" in out
    assert f"rank 7: reads {fp8 + high:,} bytes" in out
    assert f"(FP8 {fp8:,} bytes" in out and f"high precision {high:,} bytes" in out
    assert f"staging ring {64 * MiB:,} bytes" in out


def _load_small(rank: int, world: int, path: str) -> dict:
    from fsdp_fp8 import gather_state_dict, load_model
    from fsdp_fp8.interop.architectures import resolve_model_spec
    from fsdp_fp8.reading import slice_reader

    reads = []
    real = slice_reader.preadv_into

    def spy(handle, offset, buffers):
        reads.append(sum(len(b) for b in buffers))
        return real(handle, offset, buffers)

    slice_reader.preadv_into = spy
    try:
        # (through the page cache: the spy sees buffered reads; O_DIRECT ones are bounded alike)
        loaded = load_model(
            resolve_model_spec(open_checkpoint(path).config).model_fn, path, read_options=ReadOptions(direct=False)
        )
    finally:
        slice_reader.preadv_into = real
    forecast = loaded.plan.forecast(world, rank, staging_bytes=1 << 40)  # CPU: whole slices, in place
    gathered = gather_state_dict(loaded.model)
    return {
        "report": loaded.report,
        "forecast": forecast,
        "max_read": max(reads),
        "request_bytes": loaded.report.read_options.request_bytes,  # as chosen for this load
        "largest_tensor": max(e.nbytes for e in loaded.checkpoint.tensors.values()),
        "scales": len(loaded.checkpoint.scales),
        "gathered": gathered if rank == 0 else None,
    }


def test_small_model_of_the_same_structure_loads_on_4_ranks(tmp_path):
    path = write_sparse_checkpoint(SMALL, tmp_path / "ckpt", fill="random", max_shard_size=200_000)
    results = run_ranks(_load_small, 4, str(path), timeout=120)
    files = load_files(path)
    gathered = results[0]["gathered"]
    assert sorted(gathered) == sorted(files)
    for key, value in files.items():
        assert torch.equal(gathered[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key
    for r in results:
        # The load reads exactly the forecast but the scales (read once, when the checkpoint was
        # opened: 4 bytes each), in requests of at most REQUEST_BYTES (the CPU destination is
        # read into directly: no staging ring).
        assert r["report"].bytes_read == r["forecast"].read_bytes - 4 * r["scales"]
        assert r["max_read"] <= r["request_bytes"]
    total = sum(v.numel() * v.element_size() for v in files.values())
    assert total - 4 * results[0]["scales"] <= sum(r["report"].bytes_read for r in results) <= total * 1.05
