"""How FSDP2's ``Shard(0)`` splits a tensor's rows, and what that costs each rank.

FSDP2 chunks dim 0 with ``torch.chunk`` semantics: every rank gets ``ceil(rows / world)``
rows except the tail, and ranks past the last chunk get none. Its local storage is padded
to the full chunk, so what a rank *holds* can exceed what it *reads* from the checkpoint.
"""

from __future__ import annotations

from fsdp_fp8.safetensors_header import TensorEntry


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
