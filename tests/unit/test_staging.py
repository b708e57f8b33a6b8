"""The loader's transient memory is bounded: into an accelerator every read goes through one
ring of host buffers allocated once (``STAGING_BYTES`` in all), never a buffer per tensor or
file; into CPU storage it reads in place, with no staging buffer at all. Without a GPU the ring
runs into CPU destinations (``stage_cpu``) and into the meta device (a stand-in accelerator:
copying into meta checks shapes and moves nothing)."""

from __future__ import annotations

import errno
import logging
import threading

import pytest
import torch
from safetensors.torch import load_file

from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.format.safetensors_header import TensorEntry
from fsdp_fp8.load import reader
from fsdp_fp8.load.meta_build import meta_init
from fsdp_fp8.load.plan import plan_load
from fsdp_fp8.load.swap import swap_fp8_linears
from fsdp_fp8.models import MoTConfig, build_model
from fsdp_fp8.reading import direct_io, read_schedule, staging
from fsdp_fp8.reading.read_options import ReadOptions
from fsdp_fp8.reading.staging import STAGING_SLOTS
from fsdp_fp8.testing.sparse_checkpoint import write_sparse_checkpoint

CONFIG = MoTConfig(
    hidden_size=96, num_layers=2, num_heads=4, head_dim=24, intermediate_size=136, vocab_size=301, latent_channels=6
)
BUDGET = 1000  # bytes: smaller than most tensors (192-byte BF16 rows, 96-byte FP8 rows): 4 slots of 250


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


def _spy_requests(monkeypatch) -> list[read_schedule.Request]:
    calls = []
    real = read_schedule.read_request

    def spy(request, buffers, **kw):  # (kw: an O_DIRECT read's bounce buffer)
        calls.append(request)
        return real(request, buffers, **kw)

    monkeypatch.setattr(read_schedule, "read_request", spy)
    return calls


def _spy_rings(monkeypatch) -> list[staging.StagingRing]:
    rings = []

    class Recorded(staging.StagingRing):
        def __init__(self, *args):
            super().__init__(*args)
            self.most_bound = 0
            rings.append(self)

        def bind(self, request):
            views = super().bind(request)
            self.most_bound = max(self.most_bound, len(self.bound))
            return views

    monkeypatch.setattr(reader, "StagingRing", Recorded)
    return rings


def _address(view: memoryview) -> int:
    return direct_io._address(view)


def _entries(plan):
    return {**{t.entry.weight.key: t.entry.weight for t in plan.fp8}, **{t.entry.key: t.entry for t in plan.tensors}}


def test_accelerator_destination_is_staged_through_one_ring_within_the_budget(checkpoint_dir, monkeypatch):
    model, plan = _swapped_model(checkpoint_dir, "meta")
    calls, rings = _spy_requests(monkeypatch), _spy_rings(monkeypatch)
    reader._load_local(model, plan, options=ReadOptions(staging_bytes=BUDGET))
    assert len(rings) == 1  # allocated once for the whole load
    ring = rings[0]
    assert ring.nbytes <= BUDGET and len(ring.buffers) == STAGING_SLOTS
    assert ring.nbytes == plan.forecast(1, 0, staging_bytes=BUDGET).staging_peak_bytes
    assert calls and all(r.staged and r.nbytes <= ring.slot_bytes for r in calls)
    per_key: dict[str, int] = {}
    for request in calls:
        for p in request.pieces:
            per_key[p.entry.key] = per_key.get(p.entry.key, 0) + p.nbytes
    entries = _entries(plan)
    assert per_key == {k: e.nbytes for k, e in entries.items() if e.nbytes}  # every byte, once
    assert max(e.nbytes for e in entries.values()) > ring.nbytes  # big tensors went through in parts
    assert ring.copies > len(ring.buffers)  # the slots were reused, not added to
    assert 1 < ring.most_bound <= len(ring.buffers)  # several reads in flight, never more than the slots


@pytest.mark.parametrize("direct", [False, True], ids=["page cache", "O_DIRECT"])
def test_the_ring_into_cpu_storage_loads_the_files_bytes(checkpoint_dir, monkeypatch, direct):
    """The ring's whole path (bind, read, copy out, reuse) with real destinations; with O_DIRECT
    the device writes each request's aligned span into its slot, no bounce buffer between (the
    path reads into an accelerator take), and the copy out starts where the span put the bytes."""
    # 4 slots of 37 bytes: below every row (96-byte FP8, 192-byte BF16), so rows go in parts, and
    # not dividing them, so a slot also holds the end of one tensor and the start of the next.
    rings, calls = _spy_rings(monkeypatch), _spy_requests(monkeypatch)
    model, plan = _swapped_model(checkpoint_dir, "cpu")
    if direct and (refused := direct_io.open_direct(list(plan.checkpoint.handles.values()))):
        pytest.skip(f"O_DIRECT refused here: {refused[0]}")
    options = ReadOptions(staging_bytes=150, direct=direct)
    bounced, spans, read_span = [], [], direct_io.read_span
    monkeypatch.setattr(direct_io, "read_direct", lambda *a: bounced.append(a))  # the bounce path: never taken
    monkeypatch.setattr(direct_io, "read_span", lambda *a: spans.append(a[3]) or read_span(*a))
    reader._load_local(model, plan, options=options, stage_cpu=True)
    assert not bounced  # with O_DIRECT the device wrote into the slots themselves:
    slots = {_address(v) for v in rings[0].views}
    assert len(spans) == (len(calls) if direct else 0) and {_address(a) for a in spans} <= slots
    assert len(rings) == 1 and rings[0].nbytes <= 150 and rings[0].copies > 4 * len(rings[0].buffers)
    assert all(b.data_ptr() % direct_io.ALIGN == 0 for b in rings[0].buffers)
    assert any(len(r.pieces) > 1 for r in calls)
    _assert_the_files_bytes(model, plan, checkpoint_dir)


def test_slots_a_direct_read_cannot_pin_go_through_the_bounce_with_one_warning(checkpoint_dir, monkeypatch, caplog):
    """Pinned memory the kernel refuses for a direct read (a driver's mapping: ``EFAULT``): the
    request that met it and the rest of the load read through the bounce buffer, same bytes."""
    rings = _spy_rings(monkeypatch)
    model, plan = _swapped_model(checkpoint_dir, "cpu")
    if refused := direct_io.open_direct(list(plan.checkpoint.handles.values())):
        pytest.skip(f"O_DIRECT refused here: {refused[0]}")
    read_span, refusals = direct_io.read_span, []

    def refusing(fd, offset, nbytes, area):
        if _address(area) in {_address(v) for v in rings[0].views}:
            refusals.append(offset)
            raise OSError(errno.EFAULT, "Bad address")
        return read_span(fd, offset, nbytes, area)

    monkeypatch.setattr(direct_io, "read_span", refusing)
    with caplog.at_level(logging.WARNING, logger="fsdp_fp8.reading.read_schedule"):
        reader._load_local(model, plan, options=ReadOptions(staging_bytes=150, direct=True), stage_cpu=True)
    warned = [r for r in caplog.records if "staging slots refused" in r.getMessage()]
    assert len(warned) == 1 and 1 <= len(refusals) <= len(rings[0].buffers)  # (reads in flight meet it too)
    assert rings[0].copies > 4 * len(rings[0].buffers)
    _assert_the_files_bytes(model, plan, checkpoint_dir)


def _assert_the_files_bytes(model, plan, checkpoint_dir) -> None:
    files = {}
    for path in sorted(checkpoint_dir.glob("*.safetensors")):
        files.update(load_file(path))
    for t in plan.fp8:
        got = model.get_submodule(t.module).weight.qdata
        assert torch.equal(got.view(torch.uint8), files[t.entry.weight.key].view(torch.uint8)), t.module
    state = model.state_dict()
    for t in plan.tensors:
        assert torch.equal(state[t.name], files[t.entry.key]), t.name


def test_cpu_destination_is_read_in_place_with_no_ring(checkpoint_dir, monkeypatch):
    model, plan = _swapped_model(checkpoint_dir, "cpu")
    calls, rings = _spy_requests(monkeypatch), _spy_rings(monkeypatch)
    reader._load_local(model, plan, options=ReadOptions(staging_bytes=BUDGET))  # irrelevant on CPU: no staging
    assert calls and not rings and not any(r.staged for r in calls)
    keys = [p.entry.key for r in calls for p in r.pieces]
    assert len(keys) == len(set(keys)) == len([e for e in _entries(plan).values() if e.nbytes])
    assert len(calls) < len(keys)  # file-adjacent tensors were coalesced into shared preadv calls


def test_a_slot_is_reused_only_after_its_copy(monkeypatch):
    """The event of a slot's last copy is waited on before a read overwrites the slot."""
    ring = staging.StagingRing(8, 1, torch.device("cpu"))
    waited = []

    class Event:
        def synchronize(self):
            waited.append(threading.get_ident())

    ring.events[0] = Event()
    entry = TensorEntry("k", "f", None, "U8", (8,), 0, 8)
    request = read_schedule.Request((read_schedule.Piece(entry, 0, 8, torch.empty(8, dtype=torch.uint8), staged=True),))
    ring.bind(request)
    assert waited and ring.events[0] is None and not ring.ready()
    ring.finish(request, ok=False)
    assert ring.ready() and ring.copies == 0  # a failed read copies nothing out
