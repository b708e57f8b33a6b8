"""How this rank will read, chosen before the first read: ``ReadOptions`` with nothing left open.

:func:`choose_reads` decides, from the options, the page cache and the block device
(:class:`BlockQueue`): ``O_DIRECT`` where the files are on a local block device, every file takes
it and the rank's rows are not already cached (``mincore``); 4 threads, 2 on a rotational device
that is not virtual; requests of twice the device's largest transfer, within 1-16 MiB.

Each value ``ReadOptions`` fixes is kept as given; ``direct=True`` where a file refuses it is a
problem, raised before any read. ``ReadChoice.why`` says in one line what will run and why; the
load report carries it.

Design: docs/design.md, "The reader" ("How a rank reads is chosen before its first read").
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from fsdp_fp8.format.handles import OpenFile
from fsdp_fp8.reading import direct_io, read_schedule
from fsdp_fp8.reading.read_options import ReadOptions

MIN_REQUEST, MAX_REQUEST = 1 << 20, 16 << 20
DEFAULT_THREADS, DEFAULT_REQUEST = read_schedule.THREADS, read_schedule.REQUEST_BYTES
CACHE_SAMPLES = 4  # pages of the rank's rows looked up in the page cache


@dataclass(frozen=True)
class BlockQueue:
    """What the block device under a file says of itself (None: not known)."""

    rotational: bool | None  # None too where the device is virtual: virtio disks say 1 whatever backs them
    max_transfer: int | None  # bytes
    local: bool = True  # a block device with a queue; False: NFS, FUSE, tmpfs, overlay (major 0) ...

    @classmethod
    def of(cls, handle: OpenFile, sys_root: Path = Path("/sys/dev/block")) -> BlockQueue:
        dev = handle.identity.device
        block = sys_root / f"{os.major(dev)}:{os.minor(dev)}"
        virtual = any(part.startswith(("virtio", "xen")) for part in block.resolve().parts)
        for queue in (block / "queue", block / ".." / "queue"):  # a disk, or a partition of one
            rotational, sectors_kb = _read_int(queue / "rotational"), _read_int(queue / "max_sectors_kb")
            if rotational is not None or sectors_kb is not None:
                spinning = None if rotational is None or virtual else rotational == 1
                return cls(spinning, sectors_kb and sectors_kb << 10)
        return cls(None, None, local=False)

    @classmethod
    def of_files(cls, handles: list[OpenFile]) -> BlockQueue:
        """The queue of the device the first of ``handles`` is on (nothing known without one)."""
        return cls.of(handles[0]) if handles else cls(None, None)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class ReadChoice:
    """What ``choose_reads`` decided for one rank's load."""

    options: ReadOptions  # resolved: direct, threads and request_bytes set
    why: str  # one line: what runs, and why

    @property
    def prefetch_bytes(self) -> int:
        """Page-cache hints are for buffered reads only: O_DIRECT reads would not use them."""
        return 0 if self.options.direct else self.options.prefetch_bytes


def _sample(ranges: list[tuple[OpenFile, int, int]]) -> list[tuple[OpenFile, int, int]]:
    """(handle, page offset, bytes) of up to ``CACHE_SAMPLES`` pages where ``ranges`` start,
    spread over them (a page is ``ALIGN`` bytes, fewer at the end of a file)."""
    picks = sorted({round(i * (len(ranges) - 1) / max(CACHE_SAMPLES - 1, 1)) for i in range(CACHE_SAMPLES)})
    out = []
    for handle, offset, _ in (ranges[i] for i in picks if ranges):
        page = offset - offset % direct_io.ALIGN
        out.append((handle, page, min(direct_io.ALIGN, handle.identity.size - page)))
    return out


def _direct(options: ReadOptions, handles: list[OpenFile], ranges, queue: BlockQueue) -> tuple[bool, str, list[str]]:
    """(read with O_DIRECT, why, problems)."""
    if options.direct is False:
        return False, "page cache (direct=False)", []
    if options.direct is None and not queue.local:  # a network or FUSE file system: no readahead
        return False, "page cache (the files are not on a local block device)", []  # past it is slower
    sample = _sample(ranges)
    if options.direct is None and sample and all(direct_io.in_page_cache(*page) for page in sample):
        return False, "page cache (the rank's rows are cached already)", []
    refused = direct_io.open_direct(handles)
    if refused and options.direct:
        return False, "", [f"ReadOptions(direct=True) but O_DIRECT is refused: {'; '.join(refused)}"]
    if refused:
        return False, f"page cache (O_DIRECT refused: {refused[0]}{' and more' if len(refused) > 1 else ''})", []
    return True, "O_DIRECT" + (" (direct=True)" if options.direct else ""), []


def read_sizes(options: ReadOptions, queue: BlockQueue) -> tuple[int, int, list[str]]:
    """(reader threads, largest request, what the device said that they came from): the values
    ``options`` fixes, the rest from ``queue``."""
    threads, request = options.threads, options.request_bytes
    said = []
    if threads is None:
        threads = 2 if queue.rotational else DEFAULT_THREADS
        said.append("rotational" if queue.rotational else "")
    if request is None:
        request = DEFAULT_REQUEST if queue.max_transfer is None else 2 * queue.max_transfer
        request = min(max(request, MIN_REQUEST), MAX_REQUEST)
        said.append(f"max transfer {queue.max_transfer >> 10} KiB" if queue.max_transfer else "")
    return threads, request, said


def bounce_forecast(options: ReadOptions, handles: list[OpenFile], rank_bytes: int) -> tuple[int, int]:
    """(buffers, bytes each): the most an O_DIRECT load into host memory holds in bounce buffers
    (one per reader thread, sized for the largest request: never above the ``rank_bytes`` the
    rank reads), for files on ``handles``' device."""
    threads, request, _ = read_sizes(options, BlockQueue.of_files(handles))
    return threads, direct_io.bounce_bytes(min(request, max(rank_bytes, 1)))


def choose_reads(
    options: ReadOptions, handles: list[OpenFile], ranges: list[tuple[OpenFile, int, int]]
) -> tuple[ReadChoice, list[str]]:
    """This rank's reads of ``handles`` (the files it reads; ``ranges``: its (handle, offset,
    bytes)), resolved from ``options``; and the problems (a forced O_DIRECT refused), one line each."""
    queue = BlockQueue.of_files(handles)
    direct, why, problems = _direct(options, handles, ranges, queue)
    threads, request, said = read_sizes(options, queue)
    resolved = dataclasses.replace(options, direct=direct, threads=threads, request_bytes=request)
    device = ", ".join(s for s in said if s)
    line = f"{why}, {threads} threads, {request >> 10} KiB requests" + (f" (device: {device})" if device else "")
    return ReadChoice(resolved, line), problems
