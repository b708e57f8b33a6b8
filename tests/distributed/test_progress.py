"""Rank 0's load progress: bytes against the rank's forecast, GB/s and time left; a redrawn bar
on a terminal, plain lines elsewhere, nothing for short loads; and GB/s over read time only."""

from __future__ import annotations

import io

import pytest
import torch
from small_models import uneven_model_fn, write_uneven_checkpoint

from fsdp_fp8.load.progress import LoadProgress


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv("FSDP_FP8_PROGRESS", raising=False)


def _run(stream, steps, **kwargs):
    clock = Clock()
    bar = LoadProgress(10_000_000_000, stream=stream, clock=clock, **kwargs)
    for t, done in steps:
        clock.now = 100.0 + t
        bar.update(done)
    clock.now = 100.0 + steps[-1][0]
    bar.close()
    return stream.getvalue()


def test_plain_lines_when_stderr_is_not_a_terminal():
    # 10 GB forecast; 1 GB/s: at 3 s 3 GB read, 7 s left. Silent for the first 2 s; then a
    # line at most every 10 s, and the last one when the reads complete.
    out = _run(io.StringIO(), [(1, 1e9), (3, 3e9), (5, 5e9), (13, 8e9), (16, 10e9)])
    assert out.splitlines() == [
        "[fsdp_fp8] loading: 3.00/10.00 GB  30%  1.00 GB/s  7 s left",
        "[fsdp_fp8] loading: 8.00/10.00 GB  80%  0.62 GB/s  3 s left",
        "[fsdp_fp8] loading: 10.00/10.00 GB  100%  0.62 GB/s  0 s left",
        "[fsdp_fp8] loaded: read 10.00 GB in 16.0 s (0.62 GB/s)",
    ]
    assert "\r" not in out


def test_a_bar_redrawn_in_place_on_a_terminal():
    out = _run(Terminal(), [(2.5, 2.5e9), (2.55, 2.6e9), (5, 5e9)])
    frames = out.split("\r")[1:]
    assert len(frames) == 3  # 2.55 s is within 0.1 s of the last redraw
    assert frames[0].startswith("loading [######..................]  2.50/10.00 GB  25%  1.00 GB/s  8 s left")
    assert frames[1].startswith("loading [############............]  5.00/10.00 GB  50%  1.00 GB/s  5 s left")
    assert frames[2] == "loaded: read 5.00 GB in 5.0 s (1.00 GB/s)\x1b[K\n"


def test_short_loads_and_other_ranks_print_nothing(monkeypatch):
    assert _run(io.StringIO(), [(0.5, 5e9), (1.5, 10e9)]) == ""
    assert _run(io.StringIO(), [(3, 3e9), (30, 10e9)], enabled=False) == ""
    monkeypatch.setenv("FSDP_FP8_PROGRESS", "0")
    assert _run(io.StringIO(), [(3, 3e9), (30, 10e9)]) == ""
    monkeypatch.setenv("FSDP_FP8_PROGRESS", "1")
    assert _run(io.StringIO(), [(0.5, 5e9)]).startswith("[fsdp_fp8] loading: 5.00/10.00 GB  50%  10.00 GB/s")


def test_a_real_load_shows_the_rank_forecast_and_measures_gb_per_s_over_the_reads(tmp_path, monkeypatch, capsys):
    from fsdp_fp8 import load_model

    path = write_uneven_checkpoint(tmp_path)
    monkeypatch.setenv("FSDP_FP8_PROGRESS", "1")
    loaded = load_model(uneven_model_fn, path, device=torch.device("cpu"))
    err = capsys.readouterr().err
    forecast = loaded.plan.load_bytes(1, 0)  # the scales were read when the checkpoint was opened
    assert loaded.report.bytes_read == forecast
    assert f"[fsdp_fp8] loading: {forecast / 1e6:.2f}/{forecast / 1e6:.2f} MB  100%" in err


def _slow_peer(rank: int, world: int, path: str):
    import os
    import time

    from fsdp_fp8 import load_model
    from fsdp_fp8.collective import phase

    real, waited = phase.agree_on_outcome, []

    flag = f"{path}.rank0-waiting"

    def agree(*args):  # rank 1 reaches the outcome agreement 2 s after rank 0 began to wait
        start = time.perf_counter()
        if rank == 0:
            open(flag, "w").close()
        else:  # ordered, not timed: a busy machine cannot give rank 0 a head start of 2 s
            while not os.path.exists(flag):
                time.sleep(0.01)
            time.sleep(2.0)
        try:
            return real(*args)
        finally:
            waited.append(time.perf_counter() - start)

    phase.agree_on_outcome = agree
    return load_model(uneven_model_fn, path, device=torch.device("cpu")).report, waited[0]


def test_gb_per_s_is_over_the_reads_not_the_wait_for_peers(tmp_path):
    from ranks import run_ranks

    path = write_uneven_checkpoint(tmp_path)
    report, waited = run_ranks(_slow_peer, 2, str(path), timeout=120)[0]
    assert waited > 1.0  # rank 0 did wait for its slow peer (2 s after it began waiting)
    assert report.seconds >= waited  # the load's time includes the wait ...
    assert report.read_seconds <= report.seconds - waited  # ... the read time does not
    assert report.gb_per_s == report.bytes_read / report.read_seconds / 1e9


def test_progress_counts_finished_reads_not_the_reads_still_being_collected(tmp_path, monkeypatch):
    """With several workers, a read can be counted (``bytes_read``) before the loader has taken
    its completion: the bar must follow finished reads, rising once per read to the total."""
    import threading

    from safetensors.torch import save_file

    from fsdp_fp8.format.safetensors_header import read_header
    from fsdp_fp8.load import reader
    from fsdp_fp8.reading import read_schedule, slice_reader
    from fsdp_fp8.reading.read_options import ReadOptions

    entries = {}
    for i, rows in enumerate((3, 5)):
        path = tmp_path / f"s{i}.safetensors"
        save_file({f"t{i}": torch.ones(rows, 16, dtype=torch.uint8)}, str(path))
        entries.update(read_header(path, []).tensors)
    pieces = []
    for key in ("t0", "t1"):
        offset, n = slice_reader.row_range(entries[key], 0, entries[key].shape[0])
        pieces.append(reader.Piece(entries[key], offset, n, memoryview(bytearray(n))))
    second_counted = threading.Event()
    real = read_schedule.read_request

    def ordered(request, buffers, **kw):  # t0's read is counted, then waits until t1's is counted too
        got = real(request, buffers, **kw)
        if request.pieces[0].entry.key == "t1":
            second_counted.set()
        else:
            assert second_counted.wait(10)
        return got

    monkeypatch.setattr(read_schedule, "read_request", ordered)

    class Recorded:
        updates: list[int] = []

        def update(self, done):
            self.updates.append(done)

    progress = Recorded()
    assert reader._read_pieces(pieces, torch.device("cpu"), progress, options=ReadOptions(threads=2)) == []
    first, second = (p.nbytes for p in pieces)
    assert progress.updates in ([first, first + second], [second, first + second])  # once per finished read
