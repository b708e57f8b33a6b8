"""Options are values: ``ReadOptions`` is handed to ``load_model`` and down, never read from a
module global, and each load counts its own bytes (two loads in one process do not mix)."""

from __future__ import annotations

import threading

import pytest
import torch
from small_models import uneven_model_fn, write_uneven_checkpoint

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.reading import read_schedule, slice_reader
from fsdp_fp8.reading.read_options import ReadOptions


def test_bad_options_are_refused_naming_each_field():
    with pytest.raises(ArgumentError) as err:
        ReadOptions(threads=0, request_bytes=-1, prefetch_bytes=-5, in_flight=True, direct="yes")
    text = str(err.value)
    assert len(err.value.problems) == 5  # raised once, every field in it
    assert "ReadOptions.threads must be an int >= 1 or None, got 0" in text
    assert "ReadOptions.request_bytes must be an int >= 1 or None, got -1" in text
    assert "ReadOptions.prefetch_bytes must be an int >= 0, got -5" in text
    assert "ReadOptions.in_flight must be an int >= 1, got True" in text
    assert "ReadOptions.direct must be None, True or False, got 'yes'" in text
    assert ReadOptions(prefetch_bytes=0).prefetch_bytes == 0
    assert not ReadOptions().resolved and ReadOptions(direct=False, threads=1, request_bytes=4096).resolved


def test_two_loads_at_once_each_count_only_their_own_bytes(tmp_path, monkeypatch):
    from fsdp_fp8 import load_model

    a = write_uneven_checkpoint(tmp_path / "a", seed=1)
    b = write_uneven_checkpoint(tmp_path / "b", seed=2)
    b_read = threading.Event()
    real = read_schedule.read_request

    def read(request, buffers, **kw):  # every read of load a ends only after load b has read something
        got = real(request, buffers, **kw)
        if request.handle.path.parent == b:
            b_read.set()
        else:
            assert b_read.wait(30)
        return got

    monkeypatch.setattr(read_schedule, "read_request", read)
    reports: dict = {}

    def load(path, options):
        loaded = load_model(uneven_model_fn, path, device=torch.device("cpu"), read_options=options)
        reports[path] = loaded.report, loaded.plan.load_bytes(1, 0), 4 * len(loaded.checkpoint.scales)

    slice_reader.reset_bytes_read()
    threads = [
        threading.Thread(target=load, args=(a, ReadOptions(threads=1))),
        threading.Thread(target=load, args=(b, ReadOptions(request_bytes=64))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(reports) == {a, b}
    for report, forecast, _ in reports.values():
        assert report.bytes_read == forecast  # its own rows, none of the other load's
    # The process's own tally saw both loads, and the scales each read when it opened its files.
    assert slice_reader.bytes_read() == sum(f + scales for _, f, scales in reports.values())
