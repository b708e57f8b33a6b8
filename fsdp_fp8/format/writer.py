"""The one writer of ModelOpt-layout checkpoints: plan the files from shapes, then fill them.

Planning needs only each tensor's key, dtype and shape, so a layout is fixed before any data
exists. :func:`plan_checkpoint` splits tensors into shard files and lays each out as safetensors'
own ``save`` does (the same bytes); :func:`create_files` writes the headers and sizes the files
(data as holes); :class:`ShardWriter` puts bytes at offsets inside tensors (``os.pwrite``), from
any rank, in any order; :func:`write_index_and_configs` writes the index and configs as ModelOpt
0.47 lays them out. Every output is a pure function of its inputs.

Users: the dense exporter, the sparse dry-run checkpoint, the distributed save.

Design: docs/design.md, "One checkpoint writer".
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from fsdp_fp8.format.checkpoint import SCALE_SUFFIXES
from fsdp_fp8.format.safetensors_header import DTYPES

STEM = "diffusion_pytorch_model"  # diffusers' weight file stem; transformers uses "model"

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# safetensors' dtype order (its Dtype enum); files list the larger end of it first.
_DTYPE_ORDER = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "F16", "BF16", "I32", "F32", "F64", "I64")


@dataclass(frozen=True)
class TensorSpec:
    """What planning needs of one tensor."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def of(cls, key: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(key, tensor.dtype, tuple(tensor.shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Placement:
    """Where one tensor's bytes go: ``[begin, end)`` are absolute offsets in ``file``."""

    spec: TensorSpec
    file: str
    begin: int
    end: int

    @property
    def row_bytes(self) -> int:
        """Bytes in one dim-0 row; a 0-d tensor is one row holding its single element."""
        return self.spec.dtype.itemsize * math.prod(self.spec.shape[1:])


@dataclass(frozen=True)
class PlannedFile:
    name: str
    header: bytes  # the 8 length bytes, the JSON and its padding
    size: int


@dataclass(frozen=True)
class CheckpointLayout:
    files: tuple[PlannedFile, ...]
    tensors: dict[str, Placement]  # every key, sorted
    index_name: str | None  # None for a single-file checkpoint
    index: dict[str, Any] | None

    def digest_fields(self) -> tuple:
        """Everything that decides the bytes on disk, for ranks to compare before writing."""
        return tuple((f.name, f.size, f.header) for f in self.files)


def safetensors_dtype(dtype: torch.dtype) -> str | None:
    """The safetensors name of ``dtype`` (``"F8_E4M3"``, ``"BF16"``, ...), or None if it has none."""
    return _DTYPE_NAMES.get(dtype)


def dtype_problems(specs: Iterable[TensorSpec], problems: list[str]) -> None:
    for spec in specs:
        if safetensors_dtype(spec.dtype) is None:
            problems.append(f"`{spec.key}` is {spec.dtype}, which safetensors cannot store")


def plan_file(
    name: str, specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None = None
) -> tuple[PlannedFile, dict[str, Placement]]:
    """One safetensors file's header and tensor placements (what ``safetensors.torch.save`` writes)."""
    ordered = sorted(specs, key=lambda s: (-_DTYPE_ORDER.index(safetensors_dtype(s.dtype)), s.key))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for spec in ordered:
        header[spec.key] = {
            "dtype": safetensors_dtype(spec.dtype),
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    start = 8 + len(raw)
    placements = {
        s.key: Placement(s, name, start + header[s.key]["data_offsets"][0], start + header[s.key]["data_offsets"][1])
        for s in ordered
    }
    return PlannedFile(name, struct.pack("<Q", len(raw)) + raw, start + offset), placements


def _split(specs: dict[str, TensorSpec], max_shard_size: int | None, separate_scales: bool) -> list[list[str]]:
    keys = sorted(specs)
    packed = [k for k in keys if not (separate_scales and k.endswith(SCALE_SUFFIXES))]
    shards: list[list[str]] = [[]]
    size = 0
    for key in packed:
        nbytes = specs[key].nbytes
        if max_shard_size is not None and shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    if separate_scales:
        # Each scale goes to the shard after its weight's (wrapping), so scales are mixed in
        # with other weights rather than parked in one "scales" file a reader could special-case.
        if len(shards) == 1:
            shards.append([])
        home = {k: i for i, shard in enumerate(shards) for k in shard}
        for key in keys:
            if key.endswith(SCALE_SUFFIXES):
                weight_key = key.rsplit(".", 1)[0] + ".weight"
                shards[(home[weight_key] + 1) % len(shards)].append(key)
        shards = [sorted(s) for s in shards]
    return shards


def plan_checkpoint(
    specs: Iterable[TensorSpec], *, stem: str = STEM, max_shard_size: int | None = None, separate_scales: bool = False
) -> CheckpointLayout:
    """Split ``specs`` into shard files of at most ``max_shard_size`` bytes (one file when None).

    Keys are packed in sorted order; a tensor larger than the limit gets a file of its own.
    With ``separate_scales`` every FP8 scale lands in another file than its weight.
    """
    by_key = {s.key: s for s in specs}
    shards = _split(by_key, max_shard_size, separate_scales)
    files, tensors = [], {}
    for i, keys in enumerate(shards, start=1):
        name = f"{stem}.safetensors" if len(shards) == 1 else f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        planned, placements = plan_file(name, (by_key[k] for k in keys), {"format": "pt"})
        files.append(planned)
        tensors.update(placements)
    index_name = index = None
    if len(files) > 1:
        index_name = f"{stem}.safetensors.index.json"
        index = {
            "metadata": {
                "total_parameters": sum(
                    math.prod(s.shape) for k, s in by_key.items() if not k.endswith(SCALE_SUFFIXES)
                ),
                "total_size": sum(s.nbytes for s in by_key.values()),
            },
            "weight_map": {k: tensors[k].file for k in sorted(tensors)},
        }
    return CheckpointLayout(tuple(files), dict(sorted(tensors.items())), index_name, index)


def create_files(directory: Path, layout: CheckpointLayout) -> None:
    """Write each file's header and give it its full size; the data region stays a hole."""
    for planned in layout.files:
        with open(directory / planned.name, "xb") as f:
            f.write(planned.header)
            f.truncate(planned.size)


class ShardWriter:
    """Positional writes into the files of a created layout; one descriptor per file.

    ``write`` may be called in any order and from several processes at once, each on its
    own byte ranges; ``close(sync=True)`` flushes this process's writes to disk.
    """

    def __init__(self, directory: Path, layout: CheckpointLayout):
        self.layout = layout
        self._fds: dict[str, int] = {}
        try:
            for planned in layout.files:
                self._fds[planned.name] = os.open(directory / planned.name, os.O_WRONLY)
        except BaseException:
            self.close(sync=False)
            raise
        self.bytes_written = 0

    def write(self, key: str, offset: int, data) -> None:
        """Write ``data`` (a bytes-like object, e.g. ``memoryview(t.numpy())``) at byte ``offset`` of ``key``."""
        place = self.layout.tensors[key]
        view = memoryview(data).cast("B")
        if offset < 0 or place.begin + offset + len(view) > place.end:
            raise AssertionError(f"write outside `{key}`")  # internal invariant
        done, fd = 0, self._fds[place.file]
        while done < len(view):
            done += os.pwrite(fd, view[done:], place.begin + offset + done)
        self.bytes_written += done

    def write_tensor(self, key: str, tensor: torch.Tensor, row_start: int = 0) -> None:
        """Write a CPU tensor's bytes as rows ``row_start...`` of ``key`` (no copy when contiguous)."""
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if flat.numel():
            self.write(key, row_start * self.layout.tensors[key].row_bytes, flat.numpy())

    def close(self, sync: bool = True) -> None:
        fds, self._fds = self._fds, {}
        try:
            for fd in fds.values():
                if sync:
                    os.fsync(fd)
        finally:
            for fd in fds.values():
                os.close(fd)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(sync=exc_type is None)


def producer_version() -> str:
    try:
        return metadata.version("fsdp_fp8")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def producer() -> dict[str, str]:
    """What ModelOpt calls the ``producer`` of a checkpoint: this package, this version."""
    return {"name": "fsdp_fp8", "version": producer_version()}


def quantization_configs(
    ignore: list[str], *, step_policy: dict | None = None, kv_cache: bool = False, producer_info: dict | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``config.json["quantization_config"]`` and ``hf_quant_config.json`` of a static-FP8 checkpoint,
    with the keys in the order ModelOpt 0.47 writes them."""
    fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
    made_by = dict(producer_info or producer())
    qc: dict[str, Any] = {
        "config_groups": {"group_0": {"input_activations": dict(fp8), "weights": dict(fp8), "targets": ["Linear"]}},
        "ignore": list(ignore),
        "quant_algo": "FP8",
    }
    if kv_cache:
        qc["kv_cache_scheme"] = dict(fp8)
    qc["producer"] = made_by
    qc["quant_method"] = "modelopt"
    if step_policy is not None:
        qc["runtime"] = {"diffusion_step_policy": step_policy}
    hf_quant = {
        "producer": dict(made_by),
        "quantization": {
            "quant_algo": "FP8",
            "kv_cache_quant_algo": "FP8" if kv_cache else None,
            "exclude_modules": list(ignore),
        },
    }
    return qc, hf_quant


def _write_synced(path: Path, text: str) -> None:
    """A new file holding ``text``, flushed to disk before it returns (a save renames its
    directory into place next: a crash after that must not find an empty config)."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_index_and_configs(
    directory: Path, layout: CheckpointLayout, config: dict | None, hf_quant: dict | None
) -> None:
    """The index (sharded layouts only), ``config.json`` and, when given, ``hf_quant_config.json``."""
    if layout.index is not None:
        _write_synced(directory / layout.index_name, json.dumps(layout.index, indent=2) + "\n")
    # ModelOpt writes both JSON files with indent=4 and no trailing newline.
    if config is not None:
        _write_synced(directory / "config.json", json.dumps(config, indent=4))
    if hf_quant is not None:
        _write_synced(directory / "hf_quant_config.json", json.dumps(hf_quant, indent=4))


def write_checkpoint(
    directory: Path,
    tensors: Mapping[str, torch.Tensor],
    layout: CheckpointLayout,
    config: dict | None,
    hf_quant: dict | None,
) -> None:
    """The single-process path: every tensor of ``layout`` from ``tensors`` (CPU), then the JSON files."""
    create_files(directory, layout)
    with ShardWriter(directory, layout) as writer:
        for key in layout.tensors:
            writer.write_tensor(key, tensors[key])
    write_index_and_configs(directory, layout, config, hf_quant)
