"""Read exactly the bytes a rank needs: a row range of one tensor, or one scale.

Every data read in the package goes through ``counted_reads.pread_entry`` (one range),
``preadv_into`` (several file-adjacent ranges in one call: ``fsdp_fp8.reading.read_schedule``)
or ``direct_io.read_direct`` (the same, O_DIRECT), each adding what it delivered to
``fsdp_fp8.format.counted_reads``' count (``bytes_read()``, re-exported here).
"""

from __future__ import annotations

import ctypes
import math
import os

import torch

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.format import counted_reads
from fsdp_fp8.format.counted_reads import bytes_read as bytes_read  # re-exported: the one count
from fsdp_fp8.format.counted_reads import count_bytes as count_bytes
from fsdp_fp8.format.counted_reads import reset_bytes_read as reset_bytes_read
from fsdp_fp8.format.handles import OpenFile
from fsdp_fp8.format.safetensors_header import TensorEntry
from fsdp_fp8.reading.read_options import DEFAULT_READ_OPTIONS

# The default staging budget (``ReadOptions.staging_bytes``), named here for the callers that
# size a buffer from it; a load takes its own from the ``ReadOptions`` it is given.
STAGING_BYTES = DEFAULT_READ_OPTIONS.staging_bytes


def preadv_into(handle: OpenFile, offset: int, buffers: list[memoryview]) -> int:
    """Fill ``buffers`` in order from the bytes at ``offset`` (one ``preadv``, repeated only after
    a partial read); returns the bytes read, fewer only at end of file. Thread-safe: ``preadv``
    takes no file position and releases the GIL, so a thread pool can share one descriptor."""
    fd, views = handle.fileno(), [b for b in buffers if len(b)]
    done, first = 0, 0
    try:
        while first < len(views):
            n = os.preadv(fd, views[first:], offset + done)
            if n == 0:
                break
            done += n
            while first < len(views) and n >= len(views[first]):
                n -= len(views[first])
                first += 1
            if n:
                views[first] = views[first][n:]
    finally:
        count_bytes(done)
    return done


def writable(flat: torch.Tensor) -> memoryview:
    """A writable view of a contiguous uint8 CPU tensor's bytes, for ``preadv``.

    Not ``memoryview(t.numpy())``: exporting a tensor to numpy marks its storage as never
    resizable again, and a model whose load failed must be able to release its storage.
    """
    if flat.numel() == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * flat.numel()).from_address(flat.data_ptr())).cast("B")


def _rows(entry: TensorEntry) -> int:
    return entry.shape[0] if entry.shape else 1


def row_nbytes(entry: TensorEntry) -> int:
    """Bytes in one dim-0 row; a 0-d tensor is one row holding its single element."""
    return entry.torch_dtype.itemsize * math.prod(entry.shape[1:])


def row_range(entry: TensorEntry, start_row: int, stop_row: int) -> tuple[int, int]:
    """(file offset, bytes) of rows ``[start_row, stop_row)`` of ``entry``; refuses rows it lacks."""
    rows = _rows(entry)
    if not 0 <= start_row <= stop_row <= rows:
        raise ArgumentError(
            f"`{entry.key}` in {entry.file}: row range [{start_row}, {stop_row}) "
            f"is outside its {rows} rows (shape {entry.shape})",
            "slice read",
        )
    return entry.begin + start_row * row_nbytes(entry), (stop_row - start_row) * row_nbytes(entry)


def read_bytes(entry: TensorEntry, start_row: int, stop_row: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``[start_row, stop_row)`` of ``entry`` as a CPU tensor of its dtype.

    The result has shape ``(stop_row - start_row, *entry.shape[1:])`` and shares memory
    with ``out`` when given (a contiguous uint8 CPU tensor of exactly the right size).
    """
    offset, nbytes = row_range(entry, start_row, stop_row)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8)
    elif out.dtype != torch.uint8 or out.device.type != "cpu" or not out.is_contiguous() or out.numel() != nbytes:
        raise ArgumentError(
            f"`{entry.key}`: out must be a contiguous uint8 CPU tensor of {nbytes} "
            f"bytes, got {out.dtype} {tuple(out.shape)} on {out.device}",
            "slice read",
        )
    flat = out.view(-1)
    if nbytes:
        counted_reads.pread_entry(entry, offset, writable(flat))
    return flat.view(entry.torch_dtype).view((stop_row - start_row, *entry.shape[1:]))


def read_scale(entry: TensorEntry) -> torch.Tensor:
    """A one-element F32 tensor (any shape) as a 0-d float32 tensor."""
    counted_reads.require_scale(entry)
    flat = torch.empty(4, dtype=torch.uint8)
    counted_reads.pread_entry(entry, entry.begin, writable(flat))
    return flat.view(torch.float32).reshape(())
