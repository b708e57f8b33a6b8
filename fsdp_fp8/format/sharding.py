"""How FSDP2's ``Shard(0)`` splits a tensor's rows, and what that costs each rank.

FSDP2 chunks dim 0 with ``torch.chunk`` semantics: every rank gets ``ceil(rows / world)``
rows except the tail, and ranks past the last chunk get none. Its local storage is padded
to the full chunk, so what a rank *holds* can exceed what it *reads* from the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fsdp_fp8.format.safetensors_header import TensorEntry


def _check(world_size: int, rank: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")


def chunk_rows(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` that ``rank`` owns, exactly as ``torch.chunk(t, world_size)[rank]``."""
    _check(world_size, rank)
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    per_rank = -(-rows // world_size)
    return min(rank * per_rank, rows), min((rank + 1) * per_rank, rows)


def padded_rows(rows: int, world_size: int) -> int:
    """Rows in every rank's (padded) local shard."""
    _check(world_size, 0)
    return -(-rows // world_size)


def entry_rank_bytes(entry: TensorEntry, world_size: int, rank: int, padded: bool = False) -> int:
    """Bytes of ``entry`` that ``rank`` reads (or, with ``padded``, holds) under Shard(0).

    0-d tensors (scales) are replicated: every rank reads and holds all of them.
    """
    if not entry.shape:
        _check(world_size, rank)
        return entry.nbytes
    row = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
    if padded:
        return padded_rows(entry.shape[0], world_size) * row
    start, stop = chunk_rows(entry.shape[0], world_size, rank)
    return (stop - start) * row


def staging_rows(row_bytes: int, budget: int) -> int:
    """Rows per staging read into accelerator memory: as many whole rows as fit in
    ``budget``, and at least one, so a read is bounded by ``max(budget, one row)``."""
    return max(1, budget // max(row_bytes, 1))


@dataclass(frozen=True)
class RankForecast:
    """What one rank will read, hold and stage, from headers alone (every tensor Shard(0))."""

    rank: int
    fp8_bytes: int  # FP8 weight rows + the per-tensor scales (replicated: every rank reads them)
    high_precision_bytes: int  # every other tensor's rows (KV-cache scales included)
    held_bytes: int  # local storage after ``to_empty``: rows padded to ceil(rows / world)
    staging_peak_bytes: int  # largest single staging read into an accelerator (0 on CPU: in place)

    @property
    def read_bytes(self) -> int:
        return self.fp8_bytes + self.high_precision_bytes


def rank_forecast(
    fp8_entries: Iterable[TensorEntry],
    other_entries: Iterable[TensorEntry],
    world_size: int,
    rank: int,
    staging_bytes: int,
) -> RankForecast:
    """Bytes ``rank`` reads (split FP8 / high precision), holds and stages at most in one read.

    The staging peak follows the loader: a rank's rows of one tensor are read in chunks of
    ``staging_rows`` rows; a 0-d scale is one 4-byte read.
    """
    fp8_entries, other_entries = list(fp8_entries), list(other_entries)
    staged = held = 0
    for entry in fp8_entries + other_entries:
        held += entry_rank_bytes(entry, world_size, rank, padded=True)
        rows = entry.shape[0] if entry.shape else 1
        start, stop = chunk_rows(rows, world_size, rank) if entry.shape else (0, 1)
        row = entry.nbytes // rows if rows else 0
        if stop > start:
            staged = max(staged, min(stop - start, staging_rows(row, staging_bytes)) * row)
    return RankForecast(
        rank=rank,
        fp8_bytes=sum(entry_rank_bytes(e, world_size, rank) for e in fp8_entries),
        high_precision_bytes=sum(entry_rank_bytes(e, world_size, rank) for e in other_entries),
        held_bytes=held,
        staging_peak_bytes=staged,
    )
