"""What touches tensor bytes: the slice reader, and proof that opening and planning read only scales."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from ckpt_writer import small_tensors, write_checkpoint
from safetensors import safe_open
from small_models import FIXTURE, llama_on_meta

from fsdp_fp8.cli import commands as cli
from fsdp_fp8.format import counted_reads
from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.format.safetensors_header import read_header
from fsdp_fp8.load.plan import plan_load
from fsdp_fp8.reading import slice_reader
from fsdp_fp8.shard_rows import chunk_rows


@pytest.fixture
def written(tmp_path):
    t = {
        "m3": torch.arange(5 * 3 * 2, dtype=torch.float32).reshape(5, 3, 2),
        "v": torch.arange(7, dtype=torch.int16),
        "s": torch.tensor(2.5),
        "e": torch.zeros(0, 4, dtype=torch.bfloat16),
        "f8": torch.linspace(-4, 4, 12).reshape(3, 4).to(torch.float8_e4m3fn),
    }
    write_checkpoint(tmp_path, t, quant=None)
    return tmp_path, t


def entries(path) -> dict:
    # read_header, not open_checkpoint: an F8 tensor without a ModelOpt config is refused there
    problems: list[str] = []
    header = read_header(path / "model.safetensors", problems)
    assert problems == []
    return header.tensors


def test_read_bytes_every_row_range(written):
    path, t = written
    for key, expected in t.items():
        entry = entries(path)[key]
        rows = expected.shape[0] if expected.dim() else 1
        full = expected.reshape(rows, *expected.shape[1:])
        for start in range(rows + 1):
            for stop in range(start, rows + 1):
                got = slice_reader.read_bytes(entry, start, stop)
                assert got.dtype == expected.dtype and got.shape == (stop - start, *expected.shape[1:])
                assert torch.equal(got.view(torch.uint8), full[start:stop].contiguous().view(torch.uint8))


def test_read_bytes_into_out_and_its_checks(written):
    path, _ = written
    entry = entries(path)["m3"]
    out = torch.full((2 * 3 * 2 * 4,), 255, dtype=torch.uint8)
    got = slice_reader.read_bytes(entry, 1, 3, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, torch.arange(6, 18, dtype=torch.float32).reshape(2, 3, 2))
    for bad in (
        torch.empty(47, dtype=torch.uint8),
        torch.empty(48, dtype=torch.int8),
        torch.empty(96, dtype=torch.uint8)[::2],
    ):
        with pytest.raises(ValueError, match="out must be a contiguous uint8 CPU tensor of 48 bytes"):
            slice_reader.read_bytes(entry, 1, 3, out=bad)
    with pytest.raises(ValueError, match=r"`m3` .* row range \[4, 6\)"):
        slice_reader.read_bytes(entry, 4, 6)


def test_read_scale_is_0d_float32(written):
    path, _ = written
    tensors = entries(path)
    scale = slice_reader.read_scale(tensors["s"])
    assert scale.shape == () and scale.dtype == torch.float32 and float(scale) == 2.5
    with pytest.raises(ValueError, match="`v` .* F32 with one element, got I16 shape \\(7,\\)"):
        slice_reader.read_scale(tensors["v"])


def test_byte_counter_counts_exactly_what_was_read(written):
    path, _ = written
    entry = entries(path)["m3"]
    slice_reader.reset_bytes_read()
    slice_reader.read_bytes(entry, 2, 5)
    assert slice_reader.bytes_read() == 3 * 3 * 2 * 4


def test_truncation_after_open_is_reported(written):
    path, _ = written
    entry = entries(path)["m3"]
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[: entry.begin + 10])
    with pytest.raises(ValueError, match="`m3` in model.safetensors: file ended after 10 of"):
        slice_reader.read_bytes(entry, 0, 5)


def test_open_and_plan_read_only_scale_bytes(monkeypatch):
    real = counted_reads.pread_entry
    reads = []

    def guarded(entry, offset, buf):
        if not entry.key.endswith(("_scale", ".k_scale", ".v_scale")):
            raise AssertionError(f"read tensor data of `{entry.key}`")
        reads.append(entry.key)
        return real(entry, offset, buf)

    monkeypatch.setattr(counted_reads, "pread_entry", guarded)
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: (opened.append(str(p)), real_open(p, *a, **k))[1])
    slice_reader.reset_bytes_read()
    ckpt = open_checkpoint(FIXTURE)
    plan_load(ckpt, llama_on_meta())
    assert slice_reader.bytes_read() == 4 * 2 * len(ckpt.fp8_modules)
    assert sorted(reads) == sorted(
        k for m in ckpt.fp8_modules.values() for k in (m.weight_scale.key, m.input_scale.key)
    )
    # Each file is opened exactly once: the scales are read through the descriptors the headers
    # were checked through, never by reopening a path someone may have replaced meanwhile.
    assert sorted(Path(p).name for p in opened) == sorted(
        p.name for p in FIXTURE.iterdir() if p.name != "generation_config.json"
    )


def test_plan_rank_bytes_match_reading_each_rank(tmp_path):
    """Reading each rank's chunk with the slice reader costs exactly plan.rank_bytes."""
    from small_models import SmallModel, meta

    ckpt = open_checkpoint(write_checkpoint(tmp_path, small_tensors()))
    plan = plan_load(ckpt, meta(SmallModel))
    for world in (1, 2, 3, 5):
        for rank in range(world):
            slice_reader.reset_bytes_read()
            for e in [t.entry for t in plan.tensors] + [t.entry.weight for t in plan.fp8]:
                slice_reader.read_bytes(e, *chunk_rows(e.shape[0], world, rank))
            for t in plan.fp8:
                slice_reader.read_scale(t.entry.weight_scale), slice_reader.read_scale(t.entry.input_scale)
            assert slice_reader.bytes_read() == plan.rank_bytes(world, rank)


def test_fp8_bytes_equal_safetensors_view():
    ckpt = open_checkpoint(FIXTURE)
    m = ckpt.fp8_modules["model.layers.0.self_attn.q_proj"]
    with safe_open(m.weight.path, "pt") as f:
        w = f.get_tensor(m.weight.key)
    with safe_open(m.weight_scale.path, "pt") as f:
        s = f.get_tensor(m.weight_scale.key)
    assert torch.equal(slice_reader.read_bytes(m.weight, 0, 64).view(torch.uint8), w.view(torch.uint8))
    assert float(slice_reader.read_scale(m.weight_scale)) == float(s)


def test_cli_inspect_and_verify(tmp_path, capsys):
    assert cli.main(["inspect", str(FIXTURE), "--world-size", "3"]) == 0
    out = capsys.readouterr().out
    assert "producer:        modelopt 0.47.0" in out and "FP8 linears:     14" in out
    assert "rank 2: reads" in out and "step policy:     none (every denoising step W8A8)" in out
    assert cli.main(["verify", "--sha256", str(FIXTURE)]) == 0
    out = capsys.readouterr().out
    assert "model-00003-of-00005.safetensors" in out and out.startswith("OK:")
    bad = write_checkpoint(tmp_path, small_tensors())
    (bad / "model.safetensors").write_bytes(b"\0" * 4)
    assert cli.main(["inspect", str(bad)]) == 1
    assert "model.safetensors: truncated" in capsys.readouterr().err
    assert cli.main(["verify", str(tmp_path / "nope")]) == 1


def _uneven_load_bytes(rank: int, world: int, directory: str) -> dict:
    from small_models import uneven_model_fn

    from fsdp_fp8 import load_model

    loaded = load_model(uneven_model_fn, directory, device=torch.device("cpu"))
    plan = loaded.plan
    return {
        "read": loaded.report.bytes_read,
        "load_bytes": plan.load_bytes(world, rank),
        "ranges": sum(n for _, _, n in plan.rank_ranges(world, rank)),
        "forecast": plan.forecast(world, rank).read_bytes,
        "rank_bytes": plan.rank_bytes(world, rank),
        "scales": sum(e.nbytes for t in plan.fp8 for e in (t.entry.weight_scale, t.entry.input_scale)),
    }


def test_what_the_plan_says_a_rank_reads_is_what_it_reads_buffers_whole(tmp_path):
    """A persistent buffer (the uneven model's `shift`) is not sharded by FSDP2: every rank reads
    it whole, and the plan's byte counts (progress total, prefetch ranges, forecast) say so."""
    from ranks import run_ranks
    from small_models import write_uneven_checkpoint

    directory = write_uneven_checkpoint(tmp_path / "ckpt")
    for rank, got in enumerate(run_ranks(_uneven_load_bytes, 2, str(directory), timeout=120)):
        assert got["read"] == got["load_bytes"] == got["ranges"], (rank, got)
        assert got["forecast"] == got["rank_bytes"] == got["read"] + got["scales"], (rank, got)
