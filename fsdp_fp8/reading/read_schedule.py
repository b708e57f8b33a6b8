"""A rank's reads as one schedule: sorted by file and offset, file-adjacent ranges coalesced into one
``preadv``, run by a small thread pool with a bounded number of requests in flight.

:func:`schedule` turns pieces (key, file offset, bytes, destination) into requests of at most
``request_bytes`` and :data:`MAX_BUFFERS` buffers; :func:`run` hands them to ``threads`` workers,
at most ``in_flight`` at once, each on the descriptor ``open_checkpoint`` validated.

A short read or an ``OSError`` is a problem naming the key and file, and stops new submissions.
Nothing is raised before every submitted read has finished: no worker is left writing into
storage a caller is about to free.

Design: docs/design.md, "The reader".
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.format.safetensors_header import TensorEntry
from fsdp_fp8.reading import direct_io, slice_reader
from fsdp_fp8.reading.read_options import DEFAULT_READ_OPTIONS

log = logging.getLogger(__name__)

# What ``schedule`` and ``run`` use when called without a load's resolved ``ReadOptions``
# (``fsdp_fp8.reading.read_choice`` starts from them too).
REQUEST_BYTES = 8 << 20
THREADS = 4
IN_FLIGHT = DEFAULT_READ_OPTIONS.in_flight
MAX_BUFFERS = min(512, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 512)


@dataclass(frozen=True, eq=False)
class Piece:
    """``nbytes`` of ``entry`` at file offset ``offset`` into ``dest`` from byte ``at``.

    ``dest`` is a writable ``memoryview`` when the bytes are read into it directly; for a staged
    piece (``staged=True``) it is whatever the stage copies the slot into (``Stage.finish``)."""

    entry: TensorEntry
    offset: int
    nbytes: int
    dest: object
    at: int = 0
    staged: bool = False

    def __post_init__(self):
        if not (self.entry.begin <= self.offset and self.offset + self.nbytes <= self.entry.end):
            raise AssertionError(f"read outside `{self.entry.key}`")  # internal invariant


@dataclass(frozen=True, eq=False)
class Request:
    """File-adjacent pieces read by one ``preadv``."""

    pieces: tuple[Piece, ...]

    @property
    def offset(self) -> int:
        return self.pieces[0].offset

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    @property
    def staged(self) -> bool:
        return self.pieces[0].staged

    @property
    def handle(self):
        return self.pieces[0].entry.handle


class Stage(Protocol):
    """Host buffers for staged requests (``fsdp_fp8.reading.staging.StagingRing``)."""

    def ready(self) -> bool: ...  # a slot is free for the next staged request

    def bind(self, request: Request) -> list[memoryview]: ...  # a free slot, one view per piece

    def landing(self, request: Request) -> memoryview: ...  # the bound slot, aligned: an O_DIRECT read's span

    def finish(self, request: Request, ok: bool) -> None: ...  # copy the slot out (if ok), free it


def _split(piece: Piece, limit: int) -> list[Piece]:
    if piece.nbytes <= limit:
        return [piece]
    return [
        Piece(piece.entry, piece.offset + lo, min(limit, piece.nbytes - lo), piece.dest, piece.at + lo, piece.staged)
        for lo in range(0, piece.nbytes, limit)
    ]


def schedule(pieces: Iterable[Piece], request_bytes: int = REQUEST_BYTES, staged_bytes: int = 0) -> list[Request]:
    """``pieces`` as requests sorted by (file, offset); adjacent pieces in one file merged while
    a request stays within ``request_bytes`` (``ReadOptions.request_bytes``; staged pieces:
    ``staged_bytes``, one ring slot) and ``MAX_BUFFERS`` buffers. Empty pieces are dropped."""
    split = [
        part for p in pieces if p.nbytes for part in _split(p, max(1, staged_bytes if p.staged else request_bytes))
    ]
    split.sort(key=lambda p: (p.entry.file, p.offset))
    requests: list[list[Piece]] = []
    size = 0
    for p in split:
        last = requests[-1][-1] if requests else None
        limit = staged_bytes if p.staged else request_bytes
        if (
            last is not None
            and last.entry.handle is p.entry.handle
            and last.staged == p.staged
            and last.offset + last.nbytes == p.offset
            and size + p.nbytes <= limit
            and len(requests[-1]) < MAX_BUFFERS
        ):
            requests[-1].append(p)
            size += p.nbytes
        else:
            requests.append([p])
            size = p.nbytes
    return [Request(tuple(r)) for r in requests]


def read_request(
    request: Request,
    buffers: list[memoryview],
    bounce: direct_io.Bounce | None = None,
    landing: memoryview | None = None,
) -> int:
    """One request's ``preadv`` (in a worker); the bytes read. With ``bounce`` or ``landing``,
    through the file's O_DIRECT descriptor where it has one (``OpenFile.open_direct``): straight
    into ``landing`` (an aligned area ``buffers`` lie in, at the span's offset: a staging slot),
    else through ``bounce``."""
    if request.handle is None:  # every entry read_header makes holds one; a hand-made one does not
        p = request.pieces[0]
        raise ArgumentError(
            f"`{p.entry.key}` in {p.entry.file} has no open file; read it through open_checkpoint", "read schedule"
        )
    if not request.staged:  # (a slot's pages stay in after its first read: walking them again costs)
        direct_io.populate(buffers)
    fd = request.handle.direct_fileno() if bounce is not None or landing is not None else None
    if fd is not None and landing is not None:
        return direct_io.read_span(fd, request.offset, request.nbytes, landing)
    if fd is not None:
        return direct_io.read_direct(fd, request.offset, buffers, bounce)
    return slice_reader.preadv_into(request.handle, request.offset, buffers)


class _Slots:
    """Whether O_DIRECT reads may land in the staging slots. Pinned memory a direct read cannot
    pin (``EFAULT`` / ``EINVAL`` where the aligned probe into ordinary memory passed: a driver's
    mapping) turns it off for the rest of the run, with one warning; the request that met it and
    every later one go through the bounce buffer instead."""

    def __init__(self):
        self.ok = True
        self._lock = threading.Lock()

    def refuse(self, exc: OSError) -> None:
        with self._lock:
            if self.ok:
                log.warning("O_DIRECT into the staging slots refused (%s); reading through a bounce buffer", exc)
            self.ok = False


def _read_then_check(
    request: Request, buffers: list[memoryview], after_read, bounce=None, landing=None, slots=None
) -> int:
    """In a worker: the request's read, then ``after_read`` on its bytes if all arrived in place."""
    if bounce is None and landing is None:
        got = read_request(request, buffers)
    else:
        try:
            got = read_request(request, buffers, bounce=bounce, landing=landing)
        except OSError as exc:
            if landing is None or slots is None or exc.errno not in (errno.EFAULT, errno.EINVAL):
                raise
            slots.refuse(exc)
            got = read_request(request, buffers, bounce=bounce)
    if after_read is not None and got == request.nbytes and not request.staged:
        after_read(request, buffers)
    return got


def _destinations(request: Request, stage: Stage | None, direct: bool) -> tuple[list[memoryview], memoryview | None]:
    """(one buffer per piece, the aligned area an O_DIRECT read lands in or None): a staged
    request's slot (bound now), else views of the pieces' own destinations."""
    if not request.staged:
        return [p.dest[p.at : p.at + p.nbytes] for p in request.pieces], None
    buffers = stage.bind(request)
    return buffers, stage.landing(request) if direct else None


def _short(request: Request, got: int, short: dict[str, list]) -> None:
    """Fold a short read into ``short``: per key, over the pieces that came short (whatever
    order the reads finish in), [entry, bytes wanted, bytes got, first offset]."""
    at = 0
    for p in request.pieces:
        have = min(max(got - at, 0), p.nbytes)
        at += p.nbytes
        if have == p.nbytes:
            continue
        record = short.setdefault(p.entry.key, [p.entry, 0, 0, p.offset])
        record[1] += p.nbytes
        record[2] += have
        record[3] = min(record[3], p.offset)


def _failed(request: Request, exc: OSError) -> str:
    p, more = request.pieces[0], len({q.entry.key for q in request.pieces}) - 1
    also = f" (and {more} more tensors in the same read)" if more else ""
    return (
        f"`{p.entry.key}` in {p.entry.file}: reading {request.nbytes} bytes at offset {request.offset} "
        f"failed{also}: {type(exc).__name__}: {exc}"
    )


def run(
    requests: Iterable[Request],
    *,
    stage: Stage | None = None,
    threads: int = THREADS,
    in_flight: int = IN_FLIGHT,
    on_read: Callable[[int], None] | None = None,
    after_read: Callable[[Request, list[memoryview]], None] | None = None,
    direct: bool = False,
) -> list[str]:
    """Read every request; returns the problems (short or failed reads), sorted.

    ``on_read(n)`` runs on the calling thread after each finished request; so do the stage's
    ``bind`` and ``finish``. ``after_read(request, buffers)`` runs in the worker, right after a
    request read into place (not staged) arrived whole: a check of the bytes there overlaps
    the other workers' reads. ``direct``: files with an O_DIRECT descriptor are read through it,
    staged requests straight into their slot, the others through one aligned bounce buffer per
    worker (``direct_io``). Returns (or raises) only after every submitted read has finished.
    (One loop on purpose, a little over 60 lines: submission, completion and the stage's slots
    share its state, and the ``finally`` that waits for every read must cover all of it.)
    """
    in_flight = max(1, in_flight)
    pending = deque(requests)
    if any(r.staged for r in pending) and stage is None:
        raise ArgumentError("staged requests need a stage (host buffers to read into)", "read schedule")
    # (staged requests land in their slot; their bounce is allocated only if a slot is refused)
    bounce, slots = direct_io.Bounce(max(r.nbytes for r in pending)) if direct and pending else None, _Slots()
    running: dict = {}
    problems: list[str] = []
    short: dict[str, list] = {}
    stop = False
    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="fsdp_fp8-read") as pool:
        try:
            while pending or running:
                while pending and not stop and len(running) < in_flight:
                    request = pending[0]
                    if request.staged and not stage.ready():
                        break  # every slot is being read into: wait for one of those reads
                    pending.popleft()
                    buffers, landing = _destinations(request, stage, direct and slots.ok)
                    running[pool.submit(_read_then_check, request, buffers, after_read, bounce, landing, slots)] = (
                        request
                    )
                if not running:
                    break
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    request = running.pop(future)
                    got, ok = 0, False
                    try:
                        got = future.result()
                        ok = got == request.nbytes
                        if not ok:
                            _short(request, got, short)
                    except OSError as exc:
                        problems.append(_failed(request, exc))
                        stop = True
                    finally:
                        if request.staged:
                            stage.finish(request, ok)
                    if on_read is not None and got:
                        on_read(got)
        finally:
            wait(running)  # never leave a read writing into storage the caller may free
    for key, (entry, wanted, got, offset) in short.items():
        problems.append(
            f"`{key}` in {entry.file}: file ended after {got} of {wanted} bytes at offset {offset} "
            "(truncated since the header was checked?)"
        )
    return sorted(problems)
