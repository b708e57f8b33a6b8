"""The read schedule: sorted, coalesced ``preadv`` requests run by a bounded thread pool, with
honest byte counts and every failure reported once, after every read has stopped."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch
from calibration import bound
from safetensors.torch import save_file

from fsdp_fp8.format.safetensors_header import read_header
from fsdp_fp8.reading import direct_io, read_schedule, slice_reader
from fsdp_fp8.reading.read_schedule import Piece


@pytest.fixture
def shards(tmp_path):
    """Two files of tensors with distinct bytes (sizes chosen so some neighbours coalesce and
    some requests must split); returns {key: entry} and {key: the tensor's bytes}."""
    gen = torch.Generator().manual_seed(0)
    entries, data = {}, {}
    for f in range(2):
        tensors = {
            f"f{f}.t{i}": torch.randint(0, 256, (rows, 24), dtype=torch.uint8, generator=gen)
            for i, rows in enumerate([3, 40, 1, 17, 64, 2])
        }
        path = tmp_path / f"shard{f}.safetensors"
        save_file(tensors, str(path))
        problems: list[str] = []
        header = read_header(path, problems)
        assert not problems
        entries.update(header.tensors)
        data.update({k: bytes(v.reshape(-1).tolist()) for k, v in tensors.items()})
    return entries, data


def _pieces(entries, rows=None):
    """One piece per tensor (its rows [lo, hi) when ``rows`` maps key -> range), into fresh
    buffers, in a shuffled order; returns the pieces and their buffers."""
    pieces, buffers = [], {}
    keys = sorted(entries)
    random.Random(1).shuffle(keys)
    for key in keys:
        entry = entries[key]
        lo, hi = (rows or {}).get(key, (0, entry.shape[0]))
        offset, nbytes = slice_reader.row_range(entry, lo, hi)
        buffers[key] = bytearray(nbytes)
        pieces.append(Piece(entry, offset, nbytes, memoryview(buffers[key])))
    return pieces, buffers


def test_requests_are_in_file_order_coalesced_and_bounded(shards):
    entries, data = shards
    limit = 1000  # bytes: some tensors alone exceed it (40 x 24, 64 x 24)
    rows = {"f0.t1": (5, 30), "f1.t4": (0, 63)}  # a gap before f0.t2 and after f1.t4
    pieces, buffers = _pieces(entries, rows)
    requests = read_schedule.schedule(pieces, request_bytes=limit)
    order = [(p.entry.file, p.offset) for r in requests for p in r.pieces]
    assert order == sorted(order)
    for r in requests:
        assert r.nbytes <= limit
        for a, b in zip(r.pieces, r.pieces[1:]):
            assert a.entry.handle is b.entry.handle and a.offset + a.nbytes == b.offset
    for a, b in zip(requests, requests[1:]):  # nothing left unmerged that could have been merged
        end = a.pieces[-1].offset + a.pieces[-1].nbytes
        assert not (a.handle is b.handle and end == b.offset and a.nbytes + b.pieces[0].nbytes <= limit)
    assert any(len(r.pieces) > 1 for r in requests) and len(requests) < len(pieces) + 4
    slice_reader.reset_bytes_read()
    assert read_schedule.run(requests, threads=3, in_flight=4) == []
    assert slice_reader.bytes_read() == sum(p.nbytes for p in pieces)  # every byte once, nothing else
    for key, buf in buffers.items():
        lo, hi = rows.get(key, (0, entries[key].shape[0]))
        assert bytes(buf) == data[key][lo * 24 : hi * 24], key


def test_partial_preadv_results_fill_every_buffer_and_count_exactly(shards, monkeypatch):
    entries, data = shards
    real = os.preadv
    calls = []

    def dribble(fd, buffers, offset):  # the kernel may return less than asked: 7 bytes at a time
        calls.append(len(buffers))
        first = buffers[0][:7]
        return real(fd, [first], offset)

    monkeypatch.setattr(slice_reader.os, "preadv", dribble)
    pieces, buffers = _pieces({k: e for k, e in entries.items() if k.startswith("f1.")})
    slice_reader.reset_bytes_read()
    assert read_schedule.run(read_schedule.schedule(pieces), threads=2) == []
    assert slice_reader.bytes_read() == sum(p.nbytes for p in pieces) and max(calls) > 1
    assert all(bytes(buffers[k]) == data[k] for k in buffers)


def test_reads_run_in_parallel_and_in_flight_stays_bounded(shards, monkeypatch):
    entries, _ = shards
    now, most, lock = [0], [0], threading.Lock()
    real = read_schedule.read_request

    hold = bound(0.05)  # long enough for the other workers to start, on a busy machine too

    def counted(request, buffers):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(hold)
        with lock:
            now[0] -= 1
        return real(request, buffers)

    monkeypatch.setattr(read_schedule, "read_request", counted)
    pieces, _ = _pieces(entries)
    requests = read_schedule.schedule(pieces, request_bytes=200)
    assert len(requests) > 10
    assert read_schedule.run(requests, threads=4, in_flight=3) == []
    assert most[0] == 3


def _direct_or_skip(entries) -> None:
    """Give every file its O_DIRECT descriptor, or skip where this file system refuses it."""
    refused = direct_io.open_direct(list({id(e.handle): e.handle for e in entries.values()}.values()))
    if refused:
        pytest.skip(f"O_DIRECT refused here: {refused[0]}")


def test_direct_reads_deliver_the_bytes_buffered_reads_do_unaligned_ends_included(shards, monkeypatch):
    """O_DIRECT through the bounce buffer: row ranges at any offset, files whose size is no multiple
    of the alignment (every read near a file's end is widened past it), requests of a few bytes and
    of many pages; the count is the tensor bytes, never the alignment's extra."""
    entries, data = shards
    _direct_or_skip(entries)

    def no_buffered_read(*args):
        raise AssertionError("a buffered read where every file has an O_DIRECT descriptor")

    monkeypatch.setattr(slice_reader, "preadv_into", no_buffered_read)
    rows = {k: (1, e.shape[0]) for k, e in entries.items() if e.shape[0] > 2}  # rows start off alignment
    for request_bytes in (7, 4096, 1 << 20):
        pieces, buffers = _pieces(entries, rows)
        slice_reader.reset_bytes_read()
        requests = read_schedule.schedule(pieces, request_bytes=request_bytes)
        assert read_schedule.run(requests, threads=3, direct=True) == []
        for key, buf in buffers.items():
            lo, _ = rows.get(key, (0, 0))
            assert bytes(buf) == data[key][lo * 24 :], key
        assert slice_reader.bytes_read() == sum(p.nbytes for p in pieces)
        assert os.path.getsize(entries["f0.t5"].path) % direct_io.ALIGN  # the tail is unaligned


def test_direct_reads_resume_after_partial_reads(tmp_path, monkeypatch):
    """The kernel may return fewer bytes than asked (whole blocks, or up to the end of the file):
    the direct read carries on from there, and only the end of the file ends it."""
    gen = torch.Generator().manual_seed(3)
    tensors = {
        k: torch.randint(0, 256, (rows, 24), dtype=torch.uint8, generator=gen) for k, rows in (("a", 700), ("b", 333))
    }
    save_file(tensors, str(tmp_path / "big.safetensors"))
    problems: list[str] = []
    entries = read_header(tmp_path / "big.safetensors", problems).tensors
    _direct_or_skip(entries)
    real, calls = os.preadv, []

    def dribble(fd, buffers, offset):  # one block at a time
        calls.append(offset)
        return real(fd, [buffers[0][: direct_io.ALIGN]], offset)

    monkeypatch.setattr(direct_io.os, "preadv", dribble)
    pieces, buffers = _pieces(entries, {"a": (5, 700)})
    assert read_schedule.run(read_schedule.schedule(pieces), threads=2, direct=True) == []
    assert bytes(buffers["a"]) == bytes(tensors["a"][5:].reshape(-1).tolist())
    assert bytes(buffers["b"]) == bytes(tensors["b"].reshape(-1).tolist()) and len(calls) > 4


@pytest.mark.parametrize("direct", [False, True], ids=["page cache", "O_DIRECT"])
def test_truncation_names_every_short_tensor_its_file_and_both_counts(shards, direct):
    entries, _ = shards
    f0 = {k: e for k, e in entries.items() if k.startswith("f0.")}
    if direct:
        _direct_or_skip(f0)
    t4 = f0["f0.t4"]
    os.truncate(t4.path, t4.begin + 100)  # f0.t4 keeps 100 of its 1536 bytes; f0.t5 keeps none
    pieces, _ = _pieces(f0)
    slice_reader.reset_bytes_read()
    problems = read_schedule.run(read_schedule.schedule(pieces, request_bytes=512), threads=2, direct=direct)
    assert problems == [
        f"`f0.t4` in shard0.safetensors: file ended after 100 of {t4.nbytes} bytes at offset {t4.begin} "
        "(truncated since the header was checked?)",
        f"`f0.t5` in shard0.safetensors: file ended after 0 of {f0['f0.t5'].nbytes} bytes at offset "
        f"{f0['f0.t5'].begin} (truncated since the header was checked?)",
    ]
    assert slice_reader.bytes_read() == t4.begin + 100 - min(e.begin for e in f0.values())


@pytest.mark.parametrize("slow", ["the whole read", "the short reads"])
def test_a_short_tensor_is_reported_the_same_whichever_read_finishes_first(shards, monkeypatch, slow):
    """f0.t4 in three 512-byte reads, the file ending 100 bytes into the second: the problem
    counts the bytes of the reads that came short (1024 wanted, 100 got, from the second read's
    offset), whichever of the workers finishes first."""
    entries, _ = shards
    t4 = entries["f0.t4"]
    os.truncate(t4.path, t4.begin + 612)
    real = read_schedule.read_request

    def delayed(request, buffers):
        if (request.offset == t4.begin) == (slow == "the whole read"):
            time.sleep(0.2)
        return real(request, buffers)

    monkeypatch.setattr(read_schedule, "read_request", delayed)
    pieces, _ = _pieces({"f0.t4": t4})
    problems = read_schedule.run(read_schedule.schedule(pieces, request_bytes=512), threads=3)
    assert problems == [
        f"`f0.t4` in shard0.safetensors: file ended after 100 of {t4.nbytes - 512} bytes at offset "
        f"{t4.begin + 512} (truncated since the header was checked?)"
    ]


@pytest.mark.parametrize("error", [OSError, RuntimeError])
def test_a_failing_read_is_raised_once_after_every_other_read_finished(shards, monkeypatch, error):
    entries, _ = shards
    real, finished, calls = read_schedule.read_request, [], []

    def flaky(request, buffers):
        calls.append(request)
        if len(calls) == 1:
            time.sleep(0.3)  # still writing when the second read fails
            finished.append(real(request, buffers))
            return finished[-1]
        raise error(f"injected failure for `{request.pieces[0].entry.key}`")

    monkeypatch.setattr(read_schedule, "read_request", flaky)
    pieces, _ = _pieces(entries)
    requests = read_schedule.schedule(pieces, request_bytes=200)
    if error is OSError:  # a problem naming the key, file and offset
        problems = read_schedule.run(requests, threads=2, in_flight=2)
        (problem,) = problems
        assert problem.startswith(f"`{calls[1].pieces[0].entry.key}` in {calls[1].pieces[0].entry.file}: reading ")
        assert f"at offset {calls[1].offset} failed" in problem and "OSError: injected failure" in problem
    else:
        with pytest.raises(RuntimeError, match="injected failure"):
            read_schedule.run(requests, threads=2, in_flight=2)
    assert finished  # the slow read had finished before run returned or raised
    assert len(calls) < len(requests)  # nothing new was submitted after the failure
