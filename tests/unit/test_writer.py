"""The one checkpoint writer (fsdp_fp8.format.writer): its files are safetensors' own bytes,
rows written in any order land at their offsets, and the layout is planned from shapes alone."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save

from fsdp_fp8.format.safetensors_header import DTYPES
from fsdp_fp8.format.writer import (
    ShardWriter,
    TensorSpec,
    create_files,
    plan_checkpoint,
    write_checkpoint,
)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every dtype the reader knows, 0-d, empty and odd-sized tensors, keys out of order."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, dtype in enumerate(DTYPES.values()):
        shape = [(), (0, 3), (5,), (3, 7), (2, 3, 1)][i % 5]
        raw = torch.randint(
            0, 256, (max(1, torch.Size(shape).numel()) * dtype.itemsize,), generator=gen, dtype=torch.uint8
        )
        value = raw[: torch.Size(shape).numel() * dtype.itemsize].view(dtype).reshape(shape)
        out[f"z{i}.{dtype}".replace("torch.", "")] = value
        out[f"a{i}.w"] = value.clone()
    return out


def test_a_single_file_is_byte_identical_to_safetensors_save(tmp_path):
    tensors = _tensors()
    layout = plan_checkpoint([TensorSpec.of(k, t) for k, t in tensors.items()], stem="model")
    write_checkpoint(tmp_path, tensors, layout, config=None, hf_quant=None)
    (planned,) = layout.files
    assert planned.name == "model.safetensors" and layout.index is None
    assert (tmp_path / planned.name).read_bytes() == save(tensors, metadata={"format": "pt"})


def test_every_shard_is_byte_identical_to_safetensors_save_of_its_keys(tmp_path):
    tensors = _tensors(1)
    layout = plan_checkpoint([TensorSpec.of(k, t) for k, t in tensors.items()], max_shard_size=40)
    write_checkpoint(tmp_path, tensors, layout, config={"b": 1, "a": 2}, hf_quant=None)
    assert len(layout.files) > 3
    weight_map = json.loads((tmp_path / layout.index_name).read_text())["weight_map"]
    assert sorted(weight_map) == sorted(tensors)
    for planned in layout.files:
        keys = [k for k, f in weight_map.items() if f == planned.name]
        expected = save({k: tensors[k] for k in keys}, metadata={"format": "pt"})
        assert (tmp_path / planned.name).read_bytes() == expected, planned.name
    assert (tmp_path / "config.json").read_text() == json.dumps({"b": 1, "a": 2}, indent=4)
    assert not (tmp_path / "hf_quant_config.json").exists()


def test_rows_written_in_any_order_by_several_writers_land_at_their_offsets(tmp_path):
    tensors = {"w": torch.randn(7, 5).to(torch.bfloat16), "s": torch.tensor(0.5), "e": torch.randn(11)}
    layout = plan_checkpoint([TensorSpec.of(k, t) for k, t in tensors.items()])
    create_files(tmp_path, layout)
    # Three "ranks", each its own writer, rows interleaved and backwards.
    writers = [ShardWriter(tmp_path, layout) for _ in range(3)]
    for start in (6, 3, 0):
        writers[start // 3].write_tensor("w", tensors["w"][start : start + 3], row_start=start)
    writers[2].write_tensor("e", tensors["e"][4:], row_start=4)
    writers[1].write_tensor("e", tensors["e"][:4])
    writers[0].write_tensor("s", tensors["s"])
    for w in writers:
        w.close()
    assert (tmp_path / layout.files[0].name).read_bytes() == save(tensors, metadata={"format": "pt"})


def test_a_write_past_its_tensor_is_refused(tmp_path):
    layout = plan_checkpoint([TensorSpec("a", torch.float32, (2,)), TensorSpec("b", torch.float32, (2,))])
    create_files(tmp_path, layout)
    with ShardWriter(tmp_path, layout) as writer, pytest.raises(AssertionError, match="outside `a`"):
        writer.write_tensor("a", torch.zeros(2), row_start=1)


def test_create_files_never_overwrites(tmp_path):
    layout = plan_checkpoint([TensorSpec("a", torch.float32, (2,))])
    create_files(tmp_path, layout)
    with pytest.raises(FileExistsError):
        create_files(tmp_path, layout)


def test_every_file_of_a_checkpoint_is_synced_before_the_writer_returns(tmp_path, monkeypatch):
    """A save renames its directory into place right after writing: a crash then must not find
    a config or index whose bytes never reached the disk."""
    import os

    from fsdp_fp8.format import writer

    synced = []
    real = os.fsync

    def recording_fsync(fd):
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(writer.os, "fsync", recording_fsync)
    tensors = _tensors()
    layout = plan_checkpoint([TensorSpec.of(k, v) for k, v in tensors.items()], max_shard_size=64)
    write_checkpoint(tmp_path, tensors, layout, config={"a": 1}, hf_quant={"b": 2})
    assert sorted(set(synced)) == sorted(p.name for p in tmp_path.iterdir())
