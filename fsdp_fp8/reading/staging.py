"""Staging: how reads into accelerator memory (and the save's writes out of it) pass through host
memory. The sizes (:func:`staging_rows`, :func:`staging_ring`, :data:`STAGING_SLOTS`: pure
arithmetic, which the forecast uses too) and the ring itself (:class:`StagingRing`).

A read lands in slot k, which is copied to the device (``non_blocking``, on a side stream); slot k
is bound again only after that copy's event. The ring is allocated once per load, so host memory
for an accelerator load is the ring, never a buffer per tensor. Slots are pinned only where CUDA
is available. With ``O_DIRECT`` the device writes straight into the slot
(``StagingRing.landing``): no bounce buffer, no host copy.

Design: docs/design.md, "The reader" (the staging ring bullet).
"""

from __future__ import annotations

from collections import deque
from contextlib import nullcontext

import torch

from fsdp_fp8.reading import direct_io, slice_reader
from fsdp_fp8.reading.read_schedule import Request


def staging_rows(row_bytes: int, budget: int) -> int:
    """Rows per staging read into accelerator memory: as many whole rows as fit in
    ``budget``, and at least one, so a read is bounded by ``max(budget, one row)``."""
    return max(1, budget // max(row_bytes, 1))


STAGING_SLOTS = 4  # ring slots: one being copied to the device while the next ones are read


def staging_ring(staged_bytes: int, budget: int, slots: int = STAGING_SLOTS) -> tuple[int, int]:
    """(bytes per slot, slots) of the host staging ring for ``staged_bytes`` of reads into an
    accelerator: ``slots`` slots of ``budget // slots`` bytes (at least one byte each), smaller
    when less is staged, so the ring holds at most ``max(budget, slots)`` bytes and less than
    ``staged_bytes + slots``. A piece larger than a slot is read in slot-sized parts: the copy
    out is byte-exact, so no row needs to fit whole."""
    if staged_bytes <= 0:
        return 0, 0
    slots = max(slots, 1)
    slot = max(1, min(budget // slots, -(-staged_bytes // slots)))
    return slot, min(slots, -(-staged_bytes // slot))


class StagingRing:
    """``slots`` host buffers of ``slot_bytes`` each (and the alignment's margin: ``landing``);
    the ``Stage`` of ``read_schedule.run``."""

    def __init__(self, slot_bytes: int, slots: int, device: torch.device):
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.slot_bytes = slot_bytes
        # Pinning makes a CUDA context on the *current* device: made on the load's own device, a
        # ring built before set_device (or for another GPU) does not put a context on GPU 0.
        with torch.cuda.device(device) if self.cuda else nullcontext():
            self.buffers = [direct_io.aligned(slot_bytes + 2 * direct_io.ALIGN, self.cuda) for _ in range(slots)]
        self.views = [slice_reader.writable(b) for b in self.buffers]
        self.events: list = [None] * slots
        self.free = deque(range(slots))
        self.bound: dict[int, int] = {}  # id(request) -> slot (its bytes start at request.offset % ALIGN)
        self.copies = 0  # copies issued (the tests count reuse with it)
        self.stream = None
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            # The destinations were allocated (to_empty) on the current stream: copy after that.
            self.stream.wait_stream(torch.cuda.current_stream(device))

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * len(self.buffers)

    def ready(self) -> bool:
        return bool(self.free)

    def bind(self, request: Request) -> list[memoryview]:
        slot = self.free.popleft()
        if self.events[slot] is not None:  # its last copy must be done before a read overwrites it
            self.events[slot].synchronize()
            self.events[slot] = None
        assert request.nbytes <= self.slot_bytes, (request.nbytes, self.slot_bytes)
        self.bound[id(request)] = slot
        views, at = [], request.offset % direct_io.ALIGN
        for p in request.pieces:
            views.append(self.views[slot][at : at + p.nbytes])
            at += p.nbytes
        return views

    def landing(self, request: Request) -> memoryview:
        """The bound slot's aligned bytes: an O_DIRECT read of ``request``'s widened span
        (``direct_io.read_span``) into it puts each piece where ``bind``'s views are."""
        return self.views[self.bound[id(request)]]

    def finish(self, request: Request, ok: bool) -> None:
        slot = self.bound.pop(id(request))
        if ok:
            buffer, at = self.buffers[slot], request.offset % direct_io.ALIGN
            with torch.cuda.stream(self.stream) if self.cuda else nullcontext():
                for p in request.pieces:  # (narrow, not indexing: the fake-CUDA tests run this copy)
                    p.dest.narrow(0, p.at, p.nbytes).copy_(buffer.narrow(0, at, p.nbytes), non_blocking=self.cuda)
                    at += p.nbytes
                    self.copies += 1
            if self.cuda:
                event = torch.cuda.Event()
                event.record(self.stream)
                self.events[slot] = event
        self.free.append(slot)

    def drain(self) -> None:
        """Wait for every copy; later work on the current stream sees the copied bytes."""
        if self.cuda:
            self.stream.synchronize()
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
