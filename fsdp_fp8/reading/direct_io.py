"""Reads that bypass the page cache: ``O_DIRECT`` into aligned host memory, then one copy out.

A buffered cold read costs the kernel a page-cache page per 4 KiB, its readahead and the copy
out; at W ranks on few cores that is the load's CPU bill. With ``O_DIRECT`` the device writes
into our memory: :func:`read_direct` widens a request to :data:`ALIGN` at both ends, reads it
into the worker's aligned :class:`Bounce` buffer, then one ``memmove`` per piece fills its rows.

A shard's rows sit at any offset, so they cannot take a direct read in place; a staging slot is
laid out by us and takes the span itself (:func:`read_span`). The descriptor is a second one on the
validated open file (``OpenFile.open_direct``), never the path.

Design: docs/design.md, "The reader" (the ``O_DIRECT`` bullet).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

import torch

from fsdp_fp8.format.handles import OpenFile
from fsdp_fp8.reading import slice_reader

ALIGN = 4096


def aligned(nbytes: int, pin_memory: bool = False) -> torch.Tensor:
    """``nbytes`` of uint8 host memory whose first byte is ``ALIGN``-aligned, pinned if asked (a
    view into a slightly larger allocation: no allocator promises the alignment, and a pinned
    block may come from ``cudaHostAlloc``, page-aligned, or from ``malloc`` + ``cudaHostRegister``)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin_memory)
    shift = -raw.data_ptr() % ALIGN
    return raw[shift : shift + nbytes]


def probe(fd: int) -> None:
    """One aligned read through ``fd``: raises the ``OSError`` a file system that takes
    ``O_DIRECT`` at open but refuses its reads gives (``EINVAL``)."""
    buffer = aligned(ALIGN)  # held while the read writes into it: ``writable`` keeps no reference
    os.preadv(fd, [slice_reader.writable(buffer)], 0)


def open_direct(handles: list[OpenFile]) -> list[str]:
    """Give each handle its O_DIRECT descriptor; one ``"<file>: <why>"`` per refusal."""
    return [f"{h.name}: {why}" for h in handles if (why := h.open_direct(probe)) is not None]


def in_page_cache(handle, offset: int, nbytes: int = ALIGN) -> bool:
    """Whether the page cache holds every page of ``handle``'s bytes ``[offset, offset + nbytes)``:
    ``mincore`` over a mapping never touched (no read, no readahead: looking does not change
    the answer, as a ``RWF_NOWAIT`` read that misses would). False where the kernel cannot tell."""
    page = mmap.PAGESIZE
    start = offset - offset % page
    length = offset + nbytes - start
    if nbytes <= 0 or _libc is None:
        return False
    addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, handle.fileno(), start)
    if addr is None or addr == _MAP_FAILED:
        return False
    try:
        pages = (ctypes.c_ubyte * (-(-length // page)))()
        if _libc.mincore(addr, length, pages) != 0:
            return False
        return all(p & 1 for p in pages)
    finally:
        _libc.munmap(addr, length)


def _c_library():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):  # no C library with these calls: nobody can tell
        return None


_libc = _c_library()
_MAP_FAILED = ctypes.c_void_p(-1).value


def bounce_bytes(request_bytes: int) -> int:
    """One bounce buffer's bytes for requests of up to ``request_bytes``: a request's span,
    widened to ``ALIGN`` at both ends."""
    return -(-request_bytes // ALIGN) * ALIGN + ALIGN


class Bounce:
    """One aligned buffer of ``bounce_bytes(nbytes)`` per reader thread, allocated on its first request."""

    def __init__(self, nbytes: int):
        self.nbytes = bounce_bytes(nbytes)
        self._local = threading.local()

    def buffer(self) -> tuple[torch.Tensor, memoryview]:
        mine = getattr(self._local, "buffer", None)
        if mine is None:
            # An anonymous mapping (page-aligned, so ALIGN-aligned), not the allocator's: its pages
            # go back to the system when the read is done, where a freed 8 MiB malloc block may
            # stay in the process (a load's RSS would not come back to where it started).
            t = torch.frombuffer(mmap.mmap(-1, self.nbytes), dtype=torch.uint8)
            mine = self._local.buffer = (t, slice_reader.writable(t))
        return mine


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_ubyte.from_buffer(view))


MADV_POPULATE_WRITE = 23  # Linux 5.14; older kernels refuse it (EINVAL) and the reads fault as before


def populate(buffers: list[memoryview]) -> None:
    """Fault in the whole pages of fresh destinations in one ``madvise`` each, before the read
    writes them: a shard's storage straight from ``to_empty`` is untouched, and the copy would
    otherwise take one page fault per 4 KiB (measured: a quarter of the reads' system time)."""
    if _libc is None:
        return
    page = mmap.PAGESIZE
    for view in buffers:
        if len(view) < page:
            continue
        start = _address(view)
        lo, hi = -(-start // page) * page, (start + len(view)) // page * page
        if hi > lo:
            _libc.madvise(lo, hi - lo, MADV_POPULATE_WRITE)  # advice: a refusal changes nothing


def span(offset: int, nbytes: int) -> tuple[int, int]:
    """(start, bytes) of the ``ALIGN``-widened span an O_DIRECT read of ``[offset, offset + nbytes)``
    covers: the bytes land ``offset % ALIGN`` into an aligned buffer of at least that many bytes."""
    start = offset - offset % ALIGN
    return start, -(-(offset + nbytes - start) // ALIGN) * ALIGN


def read_span(fd: int, offset: int, nbytes: int, area: memoryview) -> int:
    """Read the widened span of ``[offset, offset + nbytes)`` from the O_DIRECT descriptor ``fd``
    into ``area`` (``ALIGN``-aligned, at least ``span(offset, nbytes)[1]`` bytes), so the asked
    bytes land at ``area[offset % ALIGN:]``; returns how many of them arrived (fewer only where
    the file ended). Counted in ``slice_reader.bytes_read``."""
    start, size = span(offset, nbytes)
    assert size <= len(area), (size, len(area))  # internal: the caller sized the area from the requests
    got = 0
    while got < size:
        n = os.preadv(fd, [area[got:size]], start + got)
        if n == 0:
            break
        got += n
        if got % ALIGN:  # end of file: a direct read ends short only there
            break
    have = max(0, min(nbytes, got - (offset - start)))
    slice_reader.count_bytes(have)
    return have


def read_direct(fd: int, offset: int, buffers: list[memoryview], bounce: Bounce) -> int:
    """Fill ``buffers`` in order from the bytes at ``offset`` of the O_DIRECT descriptor ``fd``,
    through this thread's bounce buffer; returns the bytes delivered (fewer only where the file
    ended). Counted in ``slice_reader.bytes_read`` like a buffered read (the alignment's extra
    bytes are not tensor bytes)."""
    tensor, view = bounce.buffer()
    have = read_span(fd, offset, sum(len(b) for b in buffers), view)
    at, src = 0, tensor.data_ptr() + offset % ALIGN
    for b in buffers:
        n = min(len(b), have - at)
        if n <= 0:
            continue  # an empty piece, or past the end of the file
        ctypes.memmove(_address(b), src + at, n)  # (ctypes releases the GIL for the call)
        at += n
    return have
