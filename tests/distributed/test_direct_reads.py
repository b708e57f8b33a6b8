"""How a rank reads, chosen before its first read (``reading.read_choice``): O_DIRECT where the files
take it and the rows are not cached, the page cache otherwise; threads and request size from the
device; a forced O_DIRECT that a file system refuses is one line, raised before any read.

The bytes an O_DIRECT read delivers (unaligned ends, short files, NaN codes) are covered where the
buffered reads are: tests/unit/test_read_schedule.py and tests/unit/test_value_checks.py."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from ranks import run_ranks
from small_models import load_files, uneven_model_fn, write_uneven_checkpoint

from fsdp_fp8 import load_model
from fsdp_fp8.errors import CheckpointError
from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.load.meta_build import storage_tensors
from fsdp_fp8.reading import direct_io, read_choice, slice_reader
from fsdp_fp8.reading.read_options import ReadOptions


def _evicted(directory) -> bool:
    """Write the files back and drop them from the page cache; whether the kernel let them go
    (tmpfs keeps them: its files live in the page cache)."""
    files = sorted(directory.glob("*.safetensors"))
    gone = True
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            gone = gone and not any(
                direct_io.in_page_cache(_Fd(fd), at, 1) for at in range(0, os.fstat(fd).st_size, 4096)
            )
        finally:
            os.close(fd)
    return gone


class _Fd:  # what in_page_cache needs of a file: fileno()
    def __init__(self, fd):
        self.fileno = lambda: fd


def _refuse_o_direct(monkeypatch):
    """A file system that refuses O_DIRECT at open (as tmpfs did before Linux 6.6)."""
    real = os.open

    def refusing(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)


def _load(directory, **options):
    """The loaded model and the bytes of every tensor it holds (inner FP8 tensors included)."""
    loaded = load_model(uneven_model_fn, directory, device=torch.device("cpu"), read_options=ReadOptions(**options))
    held = {}
    for name, t in [*loaded.model.named_parameters(), *loaded.model.named_buffers()]:
        for i, x in enumerate(storage_tensors(t)):
            held[f"{name}.{i}"] = x.detach().reshape(-1).view(torch.uint8).clone()
    return loaded, held


def test_o_direct_and_the_page_cache_load_the_same_bytes_and_the_report_says_which_ran(tmp_path):
    d = write_uneven_checkpoint(tmp_path / "ckpt")
    buffered, buffered_bytes = _load(d, direct=False)
    assert buffered.report.reads.startswith("page cache (direct=False)")
    try:
        direct, direct_bytes = _load(d, direct=True, threads=3, request_bytes=5)
    except CheckpointError as exc:
        pytest.skip(f"O_DIRECT refused here: {exc}")
    assert direct.report.reads.startswith("O_DIRECT (direct=True), 3 threads, 0 KiB requests"), direct.report.reads
    assert direct.report.prefetch_bytes == 0  # no page-cache hints for reads that bypass it
    assert direct.report.read_options.direct and direct.report.read_options.threads == 3
    assert direct.report.bytes_read == buffered.report.bytes_read
    assert direct_bytes.keys() == buffered_bytes.keys()
    for key, value in buffered_bytes.items():
        assert torch.equal(direct_bytes[key], value), key


def test_an_o_direct_load_holds_at_most_the_bounce_buffers_inspect_forecasts(tmp_path, monkeypatch):
    """Into host memory, each reader thread's bounce buffer is sized for the largest request;
    ``read_choice.bounce_forecast`` (``inspect --world-size``'s line) is the most they add up to."""
    d = write_uneven_checkpoint(tmp_path / "ckpt")
    made: list[int] = []
    real = direct_io.Bounce.buffer

    def buffer(self):
        if getattr(self._local, "buffer", None) is None:
            made.append(self.nbytes)  # this thread's first request: its buffer is allocated now
        return real(self)

    monkeypatch.setattr(direct_io.Bounce, "buffer", buffer)
    options = {"direct": True, "threads": 2, "request_bytes": 64}  # tensors of 112-192 bytes: split at 64
    try:
        loaded, _ = _load(d, **options)
    except CheckpointError as exc:
        pytest.skip(f"O_DIRECT refused here: {exc}")
    with open_checkpoint(d) as ckpt:
        buffers, each = read_choice.bounce_forecast(
            ReadOptions(**options), list(ckpt.handles.values()), loaded.report.bytes_read
        )
    assert (buffers, each) == (2, direct_io.ALIGN * 2)  # 64 bytes widened to a page, and a page to spare
    assert 1 <= len(made) <= buffers and set(made) == {each}, made


def _local_or_skip(ckpt) -> None:
    if not read_choice.BlockQueue.of(next(iter(ckpt.handles.values()))).local:
        pytest.skip("the test files are not on a local block device")


def test_off_a_local_block_device_the_page_cache_is_chosen_unless_o_direct_is_asked_for(tmp_path, monkeypatch):
    """NFS, FUSE and overlay files have no block queue: past the page cache they lose readahead."""
    d = write_uneven_checkpoint(tmp_path / "ckpt")
    with open_checkpoint(d) as ckpt:
        _evicted(d)
        monkeypatch.setattr(read_choice.BlockQueue, "of", classmethod(lambda cls, h: cls(None, None, local=False)))
        assert _choose(ckpt).why.startswith("page cache (the files are not on a local block device), ")
        try:
            forced = _choose(ckpt, direct=True)
        except AssertionError:
            pytest.skip("O_DIRECT refused here")
        assert forced.options.direct and forced.why.startswith("O_DIRECT (direct=True), ")


def _choose(ckpt, **options):
    """``choose_reads`` over every file of ``ckpt``, sampling the middle of each."""
    handles = list(ckpt.handles.values())
    ranges = [(h, h.identity.size // 2, 1) for h in handles]
    choice, problems = read_choice.choose_reads(ReadOptions(**options), handles, ranges)
    assert problems == []
    return choice


def test_the_choice_follows_the_page_cache(tmp_path):
    d = write_uneven_checkpoint(tmp_path / "ckpt")
    with open_checkpoint(d) as ckpt:
        warm = _choose(ckpt)  # freshly written: cached
        assert warm.why.startswith("page cache (the rank's rows are cached already), "), warm.why
        assert warm.prefetch_bytes == warm.options.prefetch_bytes > 0
        if not _evicted(d):
            pytest.skip("the kernel kept the files cached")
        _local_or_skip(ckpt)
        cold = _choose(ckpt)
        if "refused" in cold.why:
            pytest.skip(cold.why)
        assert cold.why.startswith("O_DIRECT, ") and cold.options.direct, cold.why
        assert cold.prefetch_bytes == 0  # hints would fill the page cache the reads bypass


def test_a_forced_o_direct_where_refused_is_one_line_before_any_read(tmp_path, monkeypatch):
    d = write_uneven_checkpoint(tmp_path / "ckpt")
    with open_checkpoint(d) as ckpt:
        scale_bytes = 4 * len(ckpt.scales)
    _refuse_o_direct(monkeypatch)
    slice_reader.reset_bytes_read()
    with pytest.raises(CheckpointError) as info:
        _load(d, direct=True)
    (problem,) = info.value.problems
    assert "\n" not in problem
    assert problem.startswith("ReadOptions(direct=True) but O_DIRECT is refused: model-0000"), problem
    assert "open with O_DIRECT: OSError: Invalid argument" in problem
    assert slice_reader.bytes_read() == scale_bytes  # the scales open_checkpoint checks, and not one row


def test_without_o_direct_the_reads_fall_back_to_the_page_cache_and_say_why(tmp_path, monkeypatch):
    d = write_uneven_checkpoint(tmp_path / "ckpt")
    with open_checkpoint(d) as ckpt:
        if not _evicted(d):
            pytest.skip("the kernel kept the files cached")
        _local_or_skip(ckpt)
        _refuse_o_direct(monkeypatch)
        choice = _choose(ckpt)
        assert choice.why.startswith("page cache (O_DIRECT refused: model-0000"), choice.why
        assert "and more" in choice.why and not choice.options.direct
        assert all(h.direct_fileno() is None for h in ckpt.handles.values())


@pytest.mark.parametrize(
    "under, rotational, sectors_kb, direct, threads, request_bytes",
    [
        ("pci0/ata1", "1", "4096", False, 2, 8 << 20),  # a spinning disk: fewer, larger requests
        ("pci0/virtio1", "1", "4096", False, 4, 8 << 20),  # virtio says rotational whatever backs it
        ("pci0/nvme0", "0", "128", False, 4, 1 << 20),  # twice 128 KiB, raised to 1 MiB
        ("pci0/nvme0", "0", "65536", False, 4, 16 << 20),  # capped
        ("pci0/nvme0", "0", "4096", True, 4, 8 << 20),  # O_DIRECT: the same rule
        ("pci0/nvme0", None, None, False, 4, 8 << 20),  # nothing said
    ],
)
def test_threads_and_request_size_come_from_the_device_unless_fixed(
    tmp_path, monkeypatch, under, rotational, sectors_kb, direct, threads, request_bytes
):
    d = write_uneven_checkpoint(tmp_path / "ckpt")
    with open_checkpoint(d) as ckpt:
        handle = next(iter(ckpt.handles.values()))
        dev = handle.identity.device
        device = tmp_path / "devices" / under
        (device / "queue").mkdir(parents=True)
        (tmp_path / "sys").mkdir()
        (tmp_path / "sys" / f"{os.major(dev)}:{os.minor(dev)}").symlink_to(device)
        if rotational is not None:
            (device / "queue" / "rotational").write_text(rotational + "\n")
            (device / "queue" / "max_sectors_kb").write_text(sectors_kb + "\n")
        real = read_choice.BlockQueue.of.__func__
        monkeypatch.setattr(read_choice.BlockQueue, "of", classmethod(lambda cls, h: real(cls, h, tmp_path / "sys")))
        choice, problems = read_choice.choose_reads(ReadOptions(direct=direct), [handle], [(handle, 0, 10)])
        if problems and direct:
            pytest.skip(problems[0])
        assert problems == [] and choice.options.direct == direct
        assert (choice.options.threads, choice.options.request_bytes) == (threads, request_bytes), choice.why
        fixed, _ = read_choice.choose_reads(ReadOptions(direct=False, threads=7, request_bytes=3), [handle], [])
        assert (fixed.options.threads, fixed.options.request_bytes) == (7, 3)
        assert fixed.why == "page cache (direct=False), 7 threads, 0 KiB requests"


def _load_direct(rank: int, world: int, path: str) -> dict:
    from fsdp_fp8 import gather_state_dict

    loaded = load_model(uneven_model_fn, path, read_options=ReadOptions(direct=True, request_bytes=24))
    gathered = gather_state_dict(loaded.model)
    return {
        "reads": loaded.report.reads,
        "read": (loaded.report.bytes_read, loaded.plan.load_bytes(world, rank)),
        "gathered": gathered if rank == 0 else None,
    }


def test_o_direct_sharded_over_3_ranks_gathers_the_files_bytes(tmp_path):
    """Uneven rows over 3 ranks (a 1-row linear: ranks with none), tiny requests so that rows
    and requests start at every alignment: the gathered model is the files, byte for byte."""
    d = write_uneven_checkpoint(tmp_path / "ckpt")
    if direct_io.open_direct(list(open_checkpoint(d).handles.values())):
        pytest.skip("O_DIRECT refused here")
    results = run_ranks(_load_direct, 3, str(d), timeout=120)
    files = load_files(d)
    assert all(r["reads"].startswith("O_DIRECT (direct=True), ") for r in results), results[0]["reads"]
    gathered = results[0]["gathered"]  # (rank 0's: the whole model)
    assert sorted(gathered) == sorted(files)
    for key, value in files.items():
        assert torch.equal(gathered[key].reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key
    assert all(r["read"][0] == r["read"][1] for r in results), [r["read"] for r in results]  # its rows, no margin
