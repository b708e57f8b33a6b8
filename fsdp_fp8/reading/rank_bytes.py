"""What one rank will read, hold and stage of a checkpoint, from its headers alone (every tensor
``Shard(0)``, rows by ``fsdp_fp8.shard_rows``): the load's forecast, the outcome wait's size and
``inspect`` / ``verify``'s per-rank lines.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fsdp_fp8.format.safetensors_header import TensorEntry
from fsdp_fp8.reading.staging import staging_ring
from fsdp_fp8.shard_rows import chunk_rows, padded_rows


def entry_rank_bytes(
    entry: TensorEntry, shards: int, shard: int, padded: bool = False, replicated: bool = False
) -> int:
    """Bytes of ``entry`` that shard coordinate ``shard`` of ``shards`` reads (or, with ``padded``,
    holds) under Shard(0).

    0-d tensors (scales) are replicated: every rank reads and holds all of them; so is a tensor
    with ``replicated`` (a buffer: FSDP2 shards parameters only).
    """
    if not entry.shape or replicated:
        chunk_rows(0, shards, shard)  # checks the coordinate
        return entry.nbytes
    row = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
    if padded:
        return padded_rows(entry.shape[0], shards) * row
    start, stop = chunk_rows(entry.shape[0], shards, shard)
    return (stop - start) * row


@dataclass(frozen=True)
class RankForecast:
    """What one shard coordinate will read, hold and stage, from headers alone (every tensor Shard(0))."""

    shard: int
    fp8_bytes: int  # FP8 weight rows + the per-tensor scales (replicated: every rank reads them)
    high_precision_bytes: int  # every other tensor's rows (KV-cache scales included)
    held_bytes: int  # local storage after ``to_empty``: rows padded to ceil(rows / world)
    staging_peak_bytes: int  # host staging ring for an accelerator destination (CPU: read in place, none)

    @property
    def read_bytes(self) -> int:
        return self.fp8_bytes + self.high_precision_bytes


def rank_forecast(
    fp8_entries: Iterable[TensorEntry],
    other_entries: Iterable[TensorEntry],
    shards: int,
    shard: int,
    staging_bytes: int,
    staged_entries: Iterable[TensorEntry] | None = None,
    replicated: frozenset[str] = frozenset(),
) -> RankForecast:
    """Bytes shard coordinate ``shard`` reads (split FP8 / high precision), holds, and stages
    through host memory.

    The staging figure follows the loader: into an accelerator every read goes through one ring
    of host buffers allocated once (``staging_ring`` of the rows the rank reads; the loader
    stages what it reads, which is these entries less the scales it already holds).
    ``staged_entries``, when given, names what is staged (default: every entry). ``replicated``:
    keys every rank reads whole (buffers: FSDP2 shards parameters only).
    """
    fp8_entries, other_entries = list(fp8_entries), list(other_entries)

    def share(e: TensorEntry, padded: bool = False) -> int:
        return entry_rank_bytes(e, shards, shard, padded, replicated=e.key in replicated)

    held = sum(share(e, padded=True) for e in fp8_entries + other_entries)
    staged = sum(share(e) for e in (fp8_entries + other_entries if staged_entries is None else staged_entries))
    slot, slots = staging_ring(staged, staging_bytes)
    return RankForecast(
        shard=shard,
        fp8_bytes=sum(share(e) for e in fp8_entries),
        high_precision_bytes=sum(share(e) for e in other_entries),
        held_bytes=held,
        staging_peak_bytes=slot * slots,
    )
