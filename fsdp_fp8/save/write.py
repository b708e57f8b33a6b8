"""A rank's part of a save's data: its rows at their offsets, and rank 0's replicated tensors.

Rows go straight from the rank's local storage into the created files (``os.pwrite``); from
an accelerator through a staging copy of at most ``staging_bytes`` at a time, so the peak is
one staging buffer. Every descriptor is synced when the rank is done.
"""

from __future__ import annotations

from pathlib import Path

from fsdp_fp8.format.writer import ShardWriter
from fsdp_fp8.reading import slice_reader
from fsdp_fp8.reading.staging import staging_rows
from fsdp_fp8.save.plan import SavePlan


def write_rank_part(tmp: Path, plan: SavePlan, staging_bytes: int) -> tuple[int, int]:
    """Write this rank's part of ``plan`` into the files in ``tmp``: (bytes written, largest
    single staging copy; 0 on CPU)."""
    staged = 0
    layout, rank = plan.layout, plan.rank
    with ShardWriter(tmp, layout) as writer:
        for item in plan.items:
            key = item.spec.key
            if item.source is not None:
                if rank == 0:
                    writer.write_tensor(key, slice_reader.read_bytes(item.source, 0, 1))
                continue
            if item.rows is None:
                if rank == 0:
                    writer.write_tensor(key, item.value.detach().reshape(item.spec.shape).cpu())
                continue
            rows = item.rows
            if rows.numel() == 0:
                continue
            row_bytes = layout.tensors[key].row_bytes
            step = rows.shape[0] if rows.device.type == "cpu" else staging_rows(row_bytes, staging_bytes)
            for lo in range(0, rows.shape[0], step):
                chunk = rows[lo : lo + step]
                if chunk.device.type != "cpu":
                    chunk = chunk.to("cpu")
                    staged = max(staged, chunk.numel() * chunk.element_size())
                writer.write_tensor(key, chunk, item.start + lo)
    return writer.bytes_written, staged
