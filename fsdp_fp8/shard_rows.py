"""How FSDP2's ``Shard(0)`` splits a tensor's rows over the shard dim: the one home of the row
arithmetic (which rows a shard coordinate owns, ``chunk_rows`` / ``rank_rows``; how many rows every
local shard is padded to, ``padded_rows``; which global ranks hold a coordinate under HSDP,
``shard_groups``). Plain integers in and out: every layer computes through these (the FP8
all-gather hook's padding, the loader's DTensor queries, the forecast, the save).

FSDP2 chunks dim 0 with ``torch.chunk`` semantics: every shard gets ``ceil(rows / shards)``
rows except the tail, and shards past the last chunk get none. Its local storage is padded
to the full chunk, so what a rank *holds* can exceed what it *reads* from the checkpoint.
The arguments are the shard-dim size and the shard coordinate, never the global world size and
rank: under HSDP (a ``(replicate, shard)`` mesh) the ranks at one coordinate of different
replicas hold the same rows.
"""

from __future__ import annotations

from fsdp_fp8.errors import ArgumentError


def _check(shards: int, shard: int) -> None:
    if shards < 1 or not 0 <= shard < shards:
        raise ArgumentError(f"shard {shard} is not one of {shards} shards", "shard rows")


def chunk_rows(rows: int, shards: int, shard: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` that ``shard`` owns, exactly as ``torch.chunk(t, shards)[shard]``."""
    _check(shards, shard)
    if rows < 0:
        raise ArgumentError(f"rows must be >= 0, got {rows}", "shard rows")
    per_shard = -(-rows // shards)
    return min(shard * per_shard, rows), min((shard + 1) * per_shard, rows)


def rank_rows(shape: tuple[int, ...], shards: int, shard: int, replicated: bool = False) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a tensor of ``shape`` that ``shard`` reads: its ``torch.chunk``
    rows, or every row of a 0-d tensor (one row) or a ``replicated`` one (a buffer)."""
    if not shape or replicated:
        _check(shards, shard)
        return 0, shape[0] if shape else 1
    return chunk_rows(shape[0], shards, shard)


def padded_rows(rows: int, shards: int) -> int:
    """Rows in every shard's (padded) local storage: ``ceil(rows / shards)``."""
    _check(shards, 0)
    return -(-rows // shards)


def shard_groups(world_size: int, replicas: int = 1) -> list[tuple[int, list[int]]]:
    """(shard coordinate, the global ranks holding it) of the mesh ``load_model`` shards over:
    ``(replicas, world_size // replicas)``, row-major as ``init_device_mesh`` lays it out."""
    shards = world_size // replicas
    return [(s, [r * shards + s for r in range(replicas)]) for s in range(shards)]
