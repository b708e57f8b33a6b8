"""Page-cache hints for a rank's rows, issued in the background while the model is set up.

While the swap, ``fully_shard`` and ``to_empty`` run, a thread hints this rank's ranges (the
``torch.chunk`` rows of its shard coordinate, ``LoadPlan.rank_ranges``), in file order, to the
kernel with ``posix_fadvise(POSIX_FADV_WILLNEED)``, ``PREFETCH_CALL_BYTES`` per call, up to
``ReadOptions.prefetch_bytes`` capped at the rank's share of half of ``MemAvailable`` (the
node's ranks, ``LOCAL_WORLD_SIZE``, share one page cache). Page cache, not this process's
memory; a hint for rows another rank reads would cost page cache, never a wrong byte. Only for
reads through the page cache: a load that reads with O_DIRECT starts none
(``fsdp_fp8.reading.read_choice.ReadChoice.prefetch_bytes``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

from fsdp_fp8.format.safetensors_header import TensorEntry
from fsdp_fp8.reading.read_options import DEFAULT_READ_OPTIONS

PREFETCH_CALL_BYTES = 8 << 20  # one hint at a time, so a stop request is honoured quickly


def available_memory() -> int | None:
    """``MemAvailable`` from /proc/meminfo in bytes; None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def local_ranks() -> int:
    """Ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``; 1 outside torchrun or if unreadable)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def prefetch_budget(budget: int = DEFAULT_READ_OPTIONS.prefetch_bytes) -> int:
    """``budget`` (``ReadOptions.prefetch_bytes``) capped at this rank's share of half of
    ``available_memory()``: the node's ranks (``local_ranks()``) hint into one page cache, and
    pages hinted beyond it would be evicted before they are read."""
    free = available_memory()
    return max(0, min(budget, free // 2 // local_ranks()) if free is not None else budget)


def prefetch_ranges(reads: Iterable[tuple[TensorEntry, int, int]], budget: int) -> list[tuple[object, int, int]]:
    """(handle, offset, bytes) to hint: ``reads`` ((entry, file offset, bytes), as
    ``LoadPlan.rank_ranges`` gives them) in file order, adjacent ones merged, cut at ``budget``
    bytes in all."""
    ranges: list[list] = []
    for entry, offset, n in sorted((r for r in reads if r[2]), key=lambda r: (r[0].file, r[1])):
        last = ranges[-1] if ranges else None
        if last is not None and last[0] is entry.handle and last[1] + last[2] == offset:
            last[2] += n
        else:
            ranges.append([entry.handle, offset, n])
    out, left = [], budget
    for handle, offset, n in ranges:
        if left <= 0:
            break
        out.append((handle, offset, min(n, left)))
        left -= n
    return out


class Prefetch:
    """A background thread hinting ``ranges`` to the kernel, ``PREFETCH_CALL_BYTES`` per call,
    until done or ``stop()`` (which joins it: no hint outlives the load's descriptors)."""

    def __init__(self, ranges: list[tuple[object, int, int]]):
        self.ranges, self.hinted = ranges, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fsdp_fp8-prefetch", daemon=True)
        if ranges and hasattr(os, "posix_fadvise"):
            self._thread.start()

    def _run(self) -> None:
        for handle, offset, n in self.ranges:
            for lo in range(0, n, PREFETCH_CALL_BYTES):
                if self._stop.is_set():
                    return
                size = min(PREFETCH_CALL_BYTES, n - lo)
                try:
                    os.posix_fadvise(handle.fileno(), offset + lo, size, os.POSIX_FADV_WILLNEED)
                except (OSError, ValueError):  # a hint only: a closed file or a refusal costs nothing
                    return
                self.hinted += size

    def stop(self) -> int:
        """Stop hinting and join; the bytes hinted."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.hinted


def start_prefetch(plan, shards: int, shard: int, budget: int) -> Prefetch:
    """A running ``Prefetch`` of the rows shard coordinate ``shard`` of ``shards`` reads from
    ``plan``, at most ``prefetch_budget(budget)`` bytes (none when that is 0)."""
    budget = prefetch_budget(budget)
    return Prefetch(prefetch_ranges(plan.rank_ranges(shards, shard), budget) if budget > 0 else [])
