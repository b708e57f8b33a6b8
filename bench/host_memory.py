"""The guest's free memory and its host: what a fresh page costs depends on whether the host
still backs it, so every load figure on a VM says which state it ran in.

A VM whose balloon reports free pages (``virtio_balloon`` with free page reporting: free blocks
of ``page_reporting_order`` and up are handed back to the host, which drops them) pays the host
again for the next first touch of that memory: a page-cache page for ``cat``, a fresh
destination for a loader. On this machine's VM that moved ``cat -2``'s CPU per GB between
0.1-0.16 and 0.66-1.35 over runs of the same command. Kernels that count what they hand back expose
``reported_kib``; every kernel with reporting has ``page_reporting_order``.

    reported_mib()        MiB handed back so far (None: the kernel does not count it)
    settle()              wait until the guest stops handing memory back (after an eviction): each
                          method then starts as on a VM left idle, its free memory with the host
    kept(warm_bytes)      a context: reporting off (order above the largest block) and
                          ``warm_bytes`` first touched once, so the run's memory stays backed, as on
                          bare metal; restored on exit, SIGTERM included (root, and a kernel that
                          takes the order: this VM's does; mainline since 6.0 refuses orders above
                          its largest block, and the write's error is then raised)
"""

from __future__ import annotations

import contextlib
import mmap
import signal
import time
from collections.abc import Iterator
from pathlib import Path

PARAMS = Path("/sys/module/page_reporting/parameters")
OFF_ORDER = 11  # above the buddy allocator's largest block (order 10): nothing is reported
QUIET_S = 4.0  # twice the kernel's reporting delay (2 s): a counter still this long is done
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def reported_mib() -> float | None:
    try:
        return int((PARAMS / "reported_kib").read_text()) / 1024
    except (OSError, ValueError):
        return None


def reporting_order() -> int | None:
    try:
        return int((PARAMS / "page_reporting_order").read_text())
    except (OSError, ValueError):
        return None


def settle(quiet_s: float = QUIET_S, most_s: float = 30.0) -> float:
    """Wait until ``reported_kib`` has not moved for ``quiet_s`` (at most ``most_s``: then a
    warning); the seconds waited. The caller checks first that the kernel counts (``reported_mib``)."""
    start = time.monotonic()
    last, still_since = reported_mib(), time.monotonic()
    while time.monotonic() - still_since < quiet_s:
        if time.monotonic() - start >= most_s:
            print(f"warning: the guest was still handing memory back after {most_s:g} s; trial started anyway")
            break
        time.sleep(0.25)
        now = reported_mib()
        if now != last:
            last, still_since = now, time.monotonic()
    return time.monotonic() - start


def first_touch(nbytes: int) -> None:
    """Fault in ``nbytes`` of fresh anonymous memory, then let it go (back to the guest's free lists)."""
    if nbytes <= 0:
        return
    area = mmap.mmap(-1, nbytes)
    try:
        area.madvise(MADV_POPULATE_WRITE)
    finally:
        area.close()


@contextlib.contextmanager
def kept(warm_bytes: int) -> Iterator[str]:
    """Free memory kept by the guest for the run; yields what was done, in words."""
    order = reporting_order()
    if order is None:
        yield "host memory: no free page reporting on this machine (nothing to keep)"
        return
    if order >= OFF_ORDER:
        raise SystemExit(
            f"--host-memory kept: {PARAMS / 'page_reporting_order'} is already {order} (reporting off): left so by an "
            f"interrupted run? Write the kernel's own value back (9 on this VM) and run again"
        )
    try:
        (PARAMS / "page_reporting_order").write_text(f"{OFF_ORDER}\n")
    except OSError as exc:
        raise SystemExit(f"--host-memory kept: cannot write {PARAMS / 'page_reporting_order'}: {exc}") from exc
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so the finally below runs
    try:
        first_touch(warm_bytes)
        yield (
            f"host memory: kept (free page reporting off for the run, order {order} -> {OFF_ORDER}; "
            f"{warm_bytes / 1e9:.1f} GB first touched before it)"
        )
    finally:
        (PARAMS / "page_reporting_order").write_text(f"{order}\n")
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)
