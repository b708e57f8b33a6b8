"""Open a ModelOpt static-FP8 (or plain high-precision) safetensors checkpoint, fail-closed.

``open_checkpoint`` reads configs, the index and every shard header, classifies each tensor
(FP8 linear weight + its two scales, KV-cache scale, or high precision) and reads the scale
values themselves (a few bytes each). It reads no other tensor data. Every problem found is
collected and raised once as a ``CheckpointError``.
"""

from __future__ import annotations

import logging
import math
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from fsdp_fp8.format.files import Layout, find_layout, resolve_directory
from fsdp_fp8.errors import raise_if_problems
from fsdp_fp8.format.quant_config import QuantConfig, read_quant_config
from fsdp_fp8.format.safetensors_header import Header, TensorEntry, load_json_object, read_header
from fsdp_fp8.format.slice_reader import read_scale

__all__ = ["Checkpoint", "Fp8ModuleEntry", "QuantConfig", "ShardFile", "TensorEntry", "open_checkpoint"]

logger = logging.getLogger(__name__)

SCALE_SUFFIXES = _SCALE_SUFFIXES = (".weight_scale", ".input_scale")
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")
# ModelOpt writes these for AWQ / NVFP4 / W4A8 exports; their presence means the weights
# are not plain static per-tensor FP8, whatever the config claims.
_FOREIGN_SUFFIXES = (".pre_quant_scale", ".weight_scale_2", ".input_scale_2")


@dataclass(frozen=True)
class ShardFile:
    name: str
    path: Path
    size: int
    header_sha256: str


@dataclass(frozen=True)
class Fp8ModuleEntry:
    name: str  # module name: the weight key without ".weight"
    weight: TensorEntry
    weight_scale: TensorEntry
    input_scale: TensorEntry
    bias: TensorEntry | None


@dataclass(frozen=True, eq=False)
class Checkpoint:
    directory: Path
    config: dict
    quant: QuantConfig
    files: dict[str, ShardFile]
    tensors: dict[str, TensorEntry]
    fp8_modules: dict[str, Fp8ModuleEntry]
    high_precision: dict[str, TensorEntry]  # includes FP8 modules' biases
    kv_scales: dict[str, TensorEntry]
    index_file: str | None = None



def _read_config(directory: Path, problems: list[str]) -> dict:
    path = directory / "config.json"
    if not path.exists():
        return {}
    return load_json_object(path.read_bytes(), "config.json", problems) or {}


def _collect_tensors(layout: Layout, headers: dict[str, Header], problems: list[str]) -> dict[str, TensorEntry]:
    if layout.weight_map is None:
        header = headers.get(layout.files[0])
        return dict(header.tensors) if header else {}
    holders: dict[str, list[str]] = defaultdict(list)
    for name, header in headers.items():
        for key in header.tensors:
            holders[key].append(name)
    tensors: dict[str, TensorEntry] = {}
    index = layout.index_file
    for key, name in layout.weight_map.items():
        if not isinstance(name, str) or name not in headers:
            continue  # the name or the file itself was refused; that problem is already recorded
        entry = headers[name].tensors.get(key)
        if entry is None:
            found = f" (it is in {holders[key]})" if holders.get(key) else ""
            problems.append(f"`{key}`: {index} maps it to {name}, which has no such tensor{found}")
        else:
            tensors[key] = entry
    for key, names in sorted(holders.items()):
        if len(names) > 1:
            problems.append(f"`{key}` is stored in several shards: {sorted(names)}")
        elif key not in layout.weight_map:
            problems.append(f"`{key}` in {names[0]} is not listed in {index}")
    return tensors


def _check_scale(entry: TensorEntry, problems: list[str]) -> bool:
    """A scale must be one finite, positive F32; reads only its 4 bytes. True when it is."""
    if entry.dtype != "F32" or entry.numel != 1:
        problems.append(f"`{entry.key}` in {entry.file} must be F32 with exactly one element, "
                        f"got {entry.dtype} shape {entry.shape}")
        return False
    try:
        value = float(read_scale(entry))
    except (OSError, ValueError) as exc:
        problems.append(f"`{entry.key}` in {entry.file}: cannot read the scale: {exc}")
        return False
    if not math.isfinite(value) or value <= 0:
        problems.append(f"`{entry.key}` in {entry.file} is {value}; a scale must be finite and > 0")
        return False
    return True


def _classify(tensors: dict[str, TensorEntry], quant: QuantConfig, config_ok: bool,
              problems: list[str]):
    fp8: dict[str, Fp8ModuleEntry] = {}
    kv: dict[str, TensorEntry] = {}
    f8_weights: set[str] = set()  # modules whose weight is stored F8_E4M3, even if malformed
    for key, e in sorted(tensors.items()):
        where = f"`{key}` in {e.file}"
        if e.dtype == "F8_E5M2":
            problems.append(f"{where} is F8_E5M2; ModelOpt static FP8 stores F8_E4M3 only")
        elif e.dtype != "F8_E4M3":
            continue
        elif not quant.is_modelopt_fp8:
            if config_ok:
                problems.append(f"{where} is stored as F8_E4M3 but the checkpoint has no ModelOpt FP8 "
                                "quantization config (hf_quant_config.json or config.json quantization_config)")
        elif not key.endswith(".weight"):
            problems.append(f"{where} is F8_E4M3 but is not a linear `.weight`")
        else:
            f8_weights.add(key[: -len(".weight")])
            if len(e.shape) != 2:
                problems.append(f"{where} is an FP8 weight with shape {e.shape}; expected 2-D [out, in]")
    if not quant.is_modelopt_fp8:
        return fp8, dict(tensors), kv
    for module in sorted(f8_weights):
        weight = tensors[f"{module}.weight"]
        scales = {}
        for suffix in _SCALE_SUFFIXES:
            scale = tensors.get(module + suffix)
            if scale is None:
                problems.append(f"`{module}.weight` in {weight.file} is F8_E4M3 but `{module}{suffix}` is missing")
            else:
                scales[suffix] = scale if _check_scale(scale, problems) else None
        if len(weight.shape) == 2 and all(scales.get(s) for s in _SCALE_SUFFIXES):
            fp8[module] = Fp8ModuleEntry(module, weight, scales[".weight_scale"], scales[".input_scale"],
                                         tensors.get(f"{module}.bias"))
            if quant.is_ignored(module):
                # The ignore list is advice, the stored dtype decides (docs/checkpoint-format.md).
                logger.warning("`%s` matches the ignore list but is stored as F8_E4M3; loading it as FP8", module)
    for key, e in sorted(tensors.items()):
        if key.endswith(_FOREIGN_SUFFIXES):
            problems.append(f"`{key}` in {e.file} belongs to a ModelOpt mode other than static per-tensor FP8")
        elif key.endswith(_SCALE_SUFFIXES):
            module = key.rsplit(".", 1)[0]
            weight = tensors.get(f"{module}.weight")
            if weight is None:
                problems.append(f"`{key}` in {e.file} is a scale without a `{module}.weight`")
            elif module not in f8_weights:
                problems.append(f"`{key}` in {e.file} is a scale for `{module}.weight`, which is stored as "
                                f"{weight.dtype}, not F8_E4M3")
        elif key.endswith(KV_SCALE_SUFFIXES):
            _check_scale(e, problems)
            kv[key] = e
    if kv and quant.kv_cache_quant_algo is None:
        problems.append(f"KV-cache scales {sorted(kv)[:2]}... are present but the quantization config "
                        "says kv_cache_quant_algo is null")
    if not kv and quant.kv_cache_quant_algo == "FP8":
        problems.append("the quantization config says kv_cache_quant_algo FP8 but there is no "
                        "`*.k_scale` / `*.v_scale` tensor")
    claimed = {m.weight.key for m in fp8.values()} | {m.weight_scale.key for m in fp8.values()} \
        | {m.input_scale.key for m in fp8.values()} | set(kv)
    high = {k: e for k, e in tensors.items() if k not in claimed}
    return fp8, high, kv


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open and fully validate the checkpoint at ``path`` (a directory or diffusers pipeline root)."""
    directory = resolve_directory(path)
    context = f"checkpoint {directory}"
    problems: list[str] = []
    config = _read_config(directory, problems)
    before = len(problems)
    quant = read_quant_config(directory, config, problems)
    quant_ok = len(problems) == before
    layout = find_layout(directory, problems)
    if layout is None:
        raise_if_problems(problems, context)
    headers: dict[str, Header] = {}
    for name in layout.files:
        header = read_header(directory / name, problems, name)
        if header is not None:
            headers[name] = header
    tensors = _collect_tensors(layout, headers, problems)
    fp8, high, kv = _classify(tensors, quant, quant_ok, problems)
    raise_if_problems(problems, context)
    files = {n: ShardFile(n, h.path, h.size, h.header_sha256) for n, h in sorted(headers.items())}
    return Checkpoint(directory, config, quant, files, dict(sorted(tensors.items())), fp8, high, kv,
                      layout.index_file)
