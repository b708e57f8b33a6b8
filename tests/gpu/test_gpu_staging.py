"""The staging ring on a real GPU: pinned slots, copies on a side stream, many slot reuses with a
small budget, and the loaded bytes on the device equal to the files. Skipped without CUDA (the
same ring runs on CPU in tests/unit/test_staging.py)."""

from __future__ import annotations

import logging

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("direct", [False, True], ids=["page cache", "O_DIRECT into the slots"])
def test_a_load_through_a_small_pinned_ring_equals_the_files(tmp_path, monkeypatch, caplog, direct):
    from safetensors.torch import load_file

    from fsdp_fp8 import load_model
    from fsdp_fp8.format.checkpoint import open_checkpoint
    from fsdp_fp8.interop.architectures import resolve_model_spec
    from fsdp_fp8.load import reader
    from fsdp_fp8.reading import direct_io, staging
    from fsdp_fp8.reading.read_options import ReadOptions
    from fsdp_fp8.testing.mot_checkpoint import write_mot_checkpoint

    path = write_mot_checkpoint(tmp_path / "ckpt")
    rings = []

    class Recorded(staging.StagingRing):
        def __init__(self, *args):
            super().__init__(*args)
            rings.append(self)

    monkeypatch.setattr(reader, "StagingRing", Recorded)
    probe = open_checkpoint(path)
    refused = direct_io.open_direct(list(probe.handles.values()))
    probe.close()
    if direct and refused:
        pytest.skip(f"O_DIRECT refused here: {refused[0]}")
    options = ReadOptions(staging_bytes=256 << 10, direct=direct)  # 4 slots of 64 KiB: reused many times
    device = torch.device("cuda", 0)
    model_fn = resolve_model_spec(open_checkpoint(path).config).model_fn
    with caplog.at_level(logging.WARNING, logger="fsdp_fp8.reading.read_schedule"):
        loaded = load_model(model_fn, path, device=device, read_options=options)
    # torch's pinned memory takes O_DIRECT reads (else the load went through the bounce, warning)
    assert not [r for r in caplog.records if "staging slots refused" in r.getMessage()]
    (ring,) = rings
    assert ring.cuda and ring.stream is not None and all(b.is_pinned() for b in ring.buffers)
    assert all(b.data_ptr() % direct_io.ALIGN == 0 for b in ring.buffers)  # O_DIRECT may write into them
    assert loaded.report.reads.startswith("O_DIRECT" if direct else "page cache"), loaded.report.reads
    assert ring.nbytes <= 256 << 10 and ring.copies > 4 * len(ring.buffers)
    files = {}
    for f in sorted(path.glob("*.safetensors")):
        files.update(load_file(f))
    state = loaded.model.state_dict()
    for name, module in loaded.model.named_modules():
        weight = getattr(module, "weight", None)
        if hasattr(weight, "qdata"):
            state[f"{name}.weight"] = weight.qdata
    data = {k: v for k, v in files.items() if v.ndim}  # the 0-d scales load from memory
    assert set(data) <= set(state)
    for key, value in data.items():
        got = state[key].detach().cpu().reshape(-1).view(torch.uint8)
        assert torch.equal(got, value.reshape(-1).view(torch.uint8)), key
