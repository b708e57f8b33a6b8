"""The loader's transient memory is bounded: into an accelerator it stages at most
``STAGING_BYTES`` (or one row, if a row is larger) per read, never a whole tensor or file;
into CPU storage it reads in place, with no staging buffer at all."""

from __future__ import annotations

import pytest

from fsdp_fp8.format import slice_reader
from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.load import loader
from fsdp_fp8.load.meta_build import meta_init
from fsdp_fp8.load.plan import plan_load
from fsdp_fp8.load.swap import swap_fp8_linears
from fsdp_fp8.models import MoTConfig, build_model
from fsdp_fp8.testing.sparse_checkpoint import write_sparse_checkpoint

CONFIG = MoTConfig(
    hidden_size=96, num_layers=2, num_heads=4, head_dim=24, intermediate_size=136, vocab_size=301, latent_channels=6
)
BUDGET = 1000  # bytes: smaller than most tensors (192-byte BF16 rows, 96-byte FP8 rows), larger than a row


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return write_sparse_checkpoint(CONFIG, tmp_path_factory.mktemp("staging") / "ckpt", fill="random")


def _swapped_model(checkpoint_dir, device):
    ckpt = open_checkpoint(checkpoint_dir)
    with meta_init():
        model = build_model(CONFIG, device="cpu")
    plan = plan_load(ckpt, model)
    swap_fp8_linears(model, plan)
    if device == "cpu":
        model.to_empty(device="cpu")
    return model, plan


def _spy_reads(monkeypatch) -> list[tuple[str, int, bool]]:
    """Every ``read_bytes`` call: (key, bytes, whether it read in place into ``out``)."""
    calls = []
    real = slice_reader.read_bytes

    def spy(entry, start, stop, out=None):
        calls.append((entry.key, (stop - start) * slice_reader.row_nbytes(entry), out is not None))
        return real(entry, start, stop, out=out)

    monkeypatch.setattr(slice_reader, "read_bytes", spy)
    return calls


def test_accelerator_destination_is_staged_in_bounded_reads(checkpoint_dir, monkeypatch):
    # A meta model stands in for accelerator memory: its tensors are not on the CPU, so the
    # loader must stage; copying into meta checks shapes and moves nothing.
    model, plan = _swapped_model(checkpoint_dir, "meta")
    monkeypatch.setattr(slice_reader, "STAGING_BYTES", BUDGET)
    calls = _spy_reads(monkeypatch)
    loader._load_local(model, plan)
    assert calls and not any(in_place for _, _, in_place in calls)
    per_key: dict[str, int] = {}
    for key, n, _ in calls:
        per_key[key] = per_key.get(key, 0) + n
    entries = {**{t.entry.weight.key: t.entry.weight for t in plan.fp8}, **{t.entry.key: t.entry for t in plan.tensors}}
    assert per_key == {k: e.nbytes for k, e in entries.items() if e.nbytes}  # every byte, once
    for key, n, _ in calls:
        assert n <= max(BUDGET, slice_reader.row_nbytes(entries[key])), key
    largest = max(n for _, n, _ in calls)
    assert largest <= BUDGET < max(e.nbytes for e in entries.values())  # never a whole big tensor
    assert largest == plan.forecast(1, 0, staging_bytes=BUDGET).staging_peak_bytes


def test_a_row_larger_than_the_budget_is_staged_one_row_at_a_time(checkpoint_dir, monkeypatch):
    model, plan = _swapped_model(checkpoint_dir, "meta")
    monkeypatch.setattr(slice_reader, "STAGING_BYTES", 50)  # below every 2-D row, above 1-D rows (2 bytes)
    calls = _spy_reads(monkeypatch)
    loader._load_local(model, plan)
    rows = {t.entry.key: slice_reader.row_nbytes(t.entry) for t in plan.tensors}
    rows.update({t.entry.weight.key: slice_reader.row_nbytes(t.entry.weight) for t in plan.fp8})
    assert any(rows[key] > 50 for key, _, _ in calls)
    assert all(n == rows[key] if rows[key] > 50 else n <= 50 for key, n, _ in calls)
    assert max(n for _, n, _ in calls) == plan.forecast(1, 0, staging_bytes=50).staging_peak_bytes


def test_cpu_destination_is_read_in_place_once_per_tensor(checkpoint_dir, monkeypatch):
    model, plan = _swapped_model(checkpoint_dir, "cpu")
    monkeypatch.setattr(slice_reader, "STAGING_BYTES", BUDGET)  # irrelevant on CPU: no staging
    calls = _spy_reads(monkeypatch)
    loader._load_local(model, plan)
    assert calls and all(in_place for _, _, in_place in calls)
    keys = [key for key, _, _ in calls]
    assert len(keys) == len(set(keys))
    assert plan.forecast(1, 0, staging_bytes=1 << 40).staging_peak_bytes == max(n for _, n, _ in calls)
