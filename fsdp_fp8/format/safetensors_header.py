"""Parse and validate one safetensors file's header without touching its tensor data.

Layout (https://github.com/huggingface/safetensors): 8-byte little-endian header length N,
N bytes of JSON, then the data region. Every offset in the header is relative to the start
of the data region, and the tensors must cover that region exactly: a gap or an overlap means
the file was not written by safetensors (or was edited), and a short data region means it was
truncated. We check all of it up front so a bad file is refused before any rank reads a byte.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fsdp_fp8.format.handles import OpenFile, load_json_object, open_regular, short_repr

__all__ = ["DTYPES", "MAX_HEADER_BYTES", "Header", "TensorEntry", "load_json_object", "read_header"]

# The safetensors reference implementation refuses headers above 100 MB; a larger one is
# either corrupt or hostile, and json.loads on it would be slow and memory hungry.
MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}

_ENTRY_FIELDS = {"dtype", "shape", "data_offsets"}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are. ``begin``/``end`` are absolute byte offsets in ``path``."""

    key: str
    file: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    # The descriptor the header was validated through; every read of this tensor uses it.
    handle: OpenFile | None = field(default=None, compare=False, repr=False)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    file: str
    path: Path
    size: int
    header_len: int
    header_sha256: str  # of the 8 length bytes + JSON: identifies the layout, not the data
    tensors: dict[str, TensorEntry]
    handle: OpenFile | None = field(default=None, compare=False, repr=False)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_entry(
    key: str, raw: object, name: str, handle: OpenFile, data_start: int, problems: list[str]
) -> TensorEntry | None:
    where = f"`{key}` in {name}"
    if not isinstance(raw, dict):
        problems.append(f"{where}: header entry is not an object")
        return None
    missing = sorted(_ENTRY_FIELDS - raw.keys())
    extra = sorted(raw.keys() - _ENTRY_FIELDS)
    if missing or extra:
        problems.append(f"{where}: header entry has missing fields {missing} / unknown fields {extra}")
        return None
    dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    ok = True
    if not isinstance(dtype, str) or dtype not in DTYPES:  # a list or object is unhashable
        problems.append(f"{where}: unknown dtype {short_repr(dtype)} (known: {', '.join(DTYPES)})")
        ok = False
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        problems.append(f"{where}: shape {short_repr(shape)} is not a list of non-negative integers")
        ok = False
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        problems.append(f"{where}: data_offsets {short_repr(offsets)} is not [begin, end] with 0 <= begin <= end")
        ok = False
    if not ok:
        return None
    expected = DTYPES[dtype].itemsize * math.prod(shape)
    if offsets[1] - offsets[0] != expected:
        problems.append(
            f"{where}: dtype {dtype} x shape {tuple(shape)} needs {expected} bytes "
            f"but data_offsets {offsets} span {offsets[1] - offsets[0]}"
        )
        return None
    return TensorEntry(
        key, name, handle.path, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1], handle
    )


def _check_coverage(entries: list[TensorEntry], name: str, data_start: int, size: int, problems: list[str]) -> None:
    """The data region must be tiled exactly: no gap, no overlap, nothing past the end."""
    cursor, previous = data_start, None
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if entry.begin < cursor:
            problems.append(f"`{entry.key}` in {name}: byte range overlaps `{previous}`")
        elif entry.begin > cursor:
            problems.append(f"`{entry.key}` in {name}: {entry.begin - cursor} unaccounted bytes before it")
        if entry.end > cursor:
            cursor, previous = entry.end, entry.key
    if cursor > size:
        problems.append(f"{name}: truncated: tensors end at byte {cursor} but the file has {size} bytes")
    elif cursor < size:
        problems.append(f"{name}: {size - cursor} trailing bytes after the last tensor")


def read_header(source: Path | OpenFile, problems: list[str], name: str | None = None) -> Header | None:
    """Read and validate the header of ``source`` (a path, or a file already opened with
    ``open_regular``), adding every problem to ``problems``; ``name`` is how messages call the file.

    Returns None when the header itself cannot be parsed; otherwise the header holds every
    entry that parsed, even when other problems exist, so callers can keep checking and
    report everything at once. The entries keep the open descriptor: their bytes are read
    from the very file that was checked.
    """
    if isinstance(source, OpenFile):
        handle, name = source, name or source.name
    else:
        name = name or Path(source).name
        handle = open_regular(Path(source), name, problems)
        if handle is None:
            return None
    size = handle.identity.size
    try:
        prefix = handle.pread(8, 0)
        if len(prefix) < 8:
            problems.append(f"{name}: truncated: {size} bytes, too short for the 8-byte header length")
            return None
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:
            problems.append(f"{name}: header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte cap")
            return None
        if 8 + header_len > size:
            problems.append(f"{name}: header length {header_len} is larger than the file ({size} bytes)")
            return None
        raw = handle.pread(header_len, 8)
    except OSError as exc:
        problems.append(f"{name}: cannot read: {type(exc).__name__}: {exc.strerror or exc}")
        return None
    if len(raw) != header_len:
        problems.append(f"{name}: truncated while reading the header")
        return None
    # The safetensors library refuses what is not strict UTF-8 JSON (a BOM, another encoding,
    # NaN); so do we, whatever Python's json would accept. Entries are type-checked one by
    # one below, so the depth bound is the parser's own.
    obj = load_json_object(raw, f"{name} header", problems, max_depth=None, constants=False)
    if obj is None:
        return None
    metadata = obj.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        problems.append(f"{name}: __metadata__ must be an object of strings, got {short_repr(metadata)}")
    data_start = 8 + header_len
    tensors: dict[str, TensorEntry] = {}
    for key, raw_entry in obj.items():
        entry = _parse_entry(key, raw_entry, name, handle, data_start, problems)
        if entry is not None:
            tensors[key] = entry
    if len(tensors) == len(obj):  # coverage is only meaningful once every range is known
        _check_coverage(list(tensors.values()), name, data_start, size, problems)
    digest = hashlib.sha256(prefix + raw).hexdigest()
    return Header(name, handle.path, size, header_len, digest, tensors, handle)
