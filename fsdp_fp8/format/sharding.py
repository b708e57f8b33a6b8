"""How FSDP2's ``Shard(0)`` splits a tensor's rows, and what that costs each rank: the one
home of the rank-row arithmetic (which rows a shard coordinate owns, ``chunk_rows`` /
``rank_rows``; which global ranks hold a coordinate under HSDP, ``shard_groups``). The loader's
DTensor queries (``fsdp_fp8.load.fsdp_wrap.local_rows``, ``shard_position``) and the CLI's
forecast compute through these.

FSDP2 chunks dim 0 with ``torch.chunk`` semantics: every rank gets ``ceil(rows / world)``
rows except the tail, and ranks past the last chunk get none. Its local storage is padded
to the full chunk, so what a rank *holds* can exceed what it *reads* from the checkpoint.
Under HSDP (a ``(replicate, shard)`` mesh) the rows follow the shard coordinate and the
shard-dim size, never the global rank and world size.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fsdp_fp8.format.safetensors_header import TensorEntry
from fsdp_fp8.format.staging import staging_ring


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


def rank_rows(shape: tuple[int, ...], world_size: int, rank: int, replicated: bool = False) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a tensor of ``shape`` that ``rank`` reads: its ``torch.chunk``
    rows, or every row of a 0-d tensor (one row) or a ``replicated`` one (a buffer)."""
    if not shape or replicated:
        _check(world_size, rank)
        return 0, shape[0] if shape else 1
    return chunk_rows(shape[0], world_size, rank)


def shard_groups(world_size: int, replicas: int = 1) -> list[tuple[int, list[int]]]:
    """(shard coordinate, the global ranks holding it) of the mesh ``load_model`` shards over:
    ``(replicas, world_size // replicas)``, row-major as ``init_device_mesh`` lays it out."""
    shards = world_size // replicas
    return [(s, [r * shards + s for r in range(replicas)]) for s in range(shards)]


def padded_rows(rows: int, world_size: int) -> int:
    """Rows in every rank's (padded) local shard."""
    _check(world_size, 0)
    return -(-rows // world_size)


def entry_rank_bytes(
    entry: TensorEntry, world_size: int, rank: int, padded: bool = False, replicated: bool = False
) -> int:
    """Bytes of ``entry`` that ``rank`` reads (or, with ``padded``, holds) under Shard(0).

    0-d tensors (scales) are replicated: every rank reads and holds all of them; so is a tensor
    with ``replicated`` (a buffer: FSDP2 shards parameters only).
    """
    if not entry.shape or replicated:
        _check(world_size, rank)
        return entry.nbytes
    row = entry.nbytes // entry.shape[0] if entry.shape[0] else 0
    if padded:
        return padded_rows(entry.shape[0], world_size) * row
    start, stop = chunk_rows(entry.shape[0], world_size, rank)
    return (stop - start) * row


@dataclass(frozen=True)
class RankForecast:
    """What one rank will read, hold and stage, from headers alone (every tensor Shard(0))."""

    rank: int
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
    world_size: int,
    rank: int,
    staging_bytes: int,
    staged_entries: Iterable[TensorEntry] | None = None,
    replicated: frozenset[str] = frozenset(),
) -> RankForecast:
    """Bytes ``rank`` reads (split FP8 / high precision), holds, and stages through host memory.

    The staging figure follows the loader: into an accelerator every read goes through one ring
    of host buffers allocated once (``staging_ring`` of the rows the rank reads; the loader
    stages what it reads, which is these entries less the scales it already holds).
    ``staged_entries``, when given, names what is staged (default: every entry). ``replicated``:
    keys every rank reads whole (buffers: FSDP2 shards parameters only).
    """
    fp8_entries, other_entries = list(fp8_entries), list(other_entries)

    def share(e: TensorEntry, padded: bool = False) -> int:
        return entry_rank_bytes(e, world_size, rank, padded, replicated=e.key in replicated)

    held = sum(share(e, padded=True) for e in fp8_entries + other_entries)
    staged = sum(share(e) for e in (fp8_entries + other_entries if staged_entries is None else staged_entries))
    slot, slots = staging_ring(staged, staging_bytes)
    return RankForecast(
        rank=rank,
        fp8_bytes=sum(share(e) for e in fp8_entries),
        high_precision_bytes=sum(share(e) for e in other_entries),
        held_bytes=held,
        staging_peak_bytes=slot * slots,
    )
