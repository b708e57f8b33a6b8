"""Every tensor-data byte the package reads, counted; and the one read ``format`` makes itself.

``bytes_read()`` is an honest count of tensor bytes this process pulled from disk: each read of
the reading engine (``fsdp_fp8.reading``) adds what it delivered through ``count_bytes``, and so
does ``pread_entry`` here. Tests use it to prove that opening and planning read only scales and
that each rank reads only its own rows. ``open_checkpoint`` checks every scale's value
(``read_scale_value``): the only data read of this layer. Reads use the descriptor the header was
validated through (``TensorEntry.handle``), never the path: a file replaced after the checks
cannot feed the reads.
"""

from __future__ import annotations

import struct
import sys
import threading

from fsdp_fp8.errors import ArgumentError, CheckpointError
from fsdp_fp8.format.safetensors_header import TensorEntry

# safetensors stores little-endian; viewing the bytes in place is only right on such hosts.
if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("fsdp_fp8 reads safetensors in place and needs a little-endian host")

_lock = threading.Lock()
_bytes_read = 0


def bytes_read() -> int:
    """Tensor-data bytes read by this process since the last reset: every load's and every
    other read's, together (a load's own count is ``LoadReport.bytes_read``)."""
    return _bytes_read


def reset_bytes_read() -> None:
    global _bytes_read
    with _lock:
        _bytes_read = 0


def count_bytes(n: int) -> None:
    """Add ``n`` tensor-data bytes to ``bytes_read()`` (every reader of the package calls it)."""
    global _bytes_read
    with _lock:
        _bytes_read += n


def pread_entry(entry: TensorEntry, offset: int, buf: memoryview) -> None:
    """Fill ``buf`` from ``offset`` inside ``entry``'s bytes, through its open file; counted."""
    if not (entry.begin <= offset and offset + len(buf) <= entry.end):
        raise AssertionError(f"read outside `{entry.key}`")  # internal invariant
    if entry.handle is None:  # every entry read_header makes holds one; a hand-made one does not
        raise ArgumentError(
            f"`{entry.key}` in {entry.file} has no open file; read it through open_checkpoint or read_header",
            "slice read",
        )
    done = entry.handle.pread_into(buf, offset)
    if done < len(buf):
        raise CheckpointError(
            f"`{entry.key}` in {entry.file}: file ended after {done} of {len(buf)} "
            f"bytes at offset {offset} (truncated since the header was checked?)",
            "checkpoint changed during the read",
        )
    count_bytes(done)


def require_scale(entry: TensorEntry) -> None:
    """Refuse an entry that is not a scale: F32 with one element."""
    if entry.dtype != "F32" or entry.numel != 1:
        raise ArgumentError(
            f"`{entry.key}` in {entry.file}: a scale must be F32 with one element, "
            f"got {entry.dtype} shape {entry.shape}",
            "slice read",
        )


def read_scale_value(entry: TensorEntry) -> float:
    """A scale's value as a float, without a tensor: ``open_checkpoint`` checks every scale of
    the checkpoint (1,792 at Super scale), and a tensor cost more than the read."""
    require_scale(entry)
    raw = bytearray(4)
    pread_entry(entry, entry.begin, memoryview(raw))
    return struct.unpack("<f", raw)[0]
