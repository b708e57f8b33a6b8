"""Open a ModelOpt static-FP8 (or plain high-precision) safetensors checkpoint, fail-closed.

``open_checkpoint`` reads configs, the index and every shard header, classifies each tensor
(FP8 linear weight + its two scales, KV-cache scale, or high precision) and reads the scale
values themselves (a few bytes each). It reads no other tensor data. Every problem found is
collected and raised once as a ``CheckpointError``.

Each shard is opened once and held (``Checkpoint.handles``) until ``close()``: the loader
reads through the same descriptors the headers were checked through, and uses the scale
values checked here (``Checkpoint.scales``), never a second read of them.
"""

from __future__ import annotations

import logging
import math
import os
import resource
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fsdp_fp8.errors import raise_if_problems
from fsdp_fp8.format.counted_reads import read_scale_value
from fsdp_fp8.format.files import Layout, find_layout, resolve_directory
from fsdp_fp8.format.handles import OpenFile, open_regular, present, read_json_file, short_repr
from fsdp_fp8.format.quant_config import QuantConfig, parse_quant_config
from fsdp_fp8.format.safetensors_header import Header, TensorEntry, read_header

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
    scales: dict[str, float] = field(default_factory=dict)  # every validated scale's value (float32-exact)
    json_files: dict[str, dict] = field(default_factory=dict)  # file name -> parsed config / index
    handles: dict[str, OpenFile] = field(default_factory=dict, repr=False)  # shard name -> held descriptor

    def changed_files(self) -> list[str]:
        """A problem for every shard rewritten in place or replaced since it was opened."""
        return [p for name, handle in sorted(self.handles.items()) for p in handle.changes()]

    def close(self) -> None:
        """Release the held descriptors; reading tensor data afterwards raises."""
        for handle in self.handles.values():
            handle.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_json(directory: Path, name: str, problems: list[str], json_files: dict[str, dict]) -> dict | None:
    if not present(directory / name):
        return None
    obj = read_json_file(directory / name, name, problems)
    if obj is not None:
        json_files[name] = obj
    return obj


# Numeric config fields the model's arithmetic divides by or exponentiates: zero, negative or
# non-finite values build a model that computes garbage without an error.
POSITIVE_FIELDS = frozenset(
    {
        "rms_eps",
        "rms_norm_eps",
        "layer_norm_eps",
        "layer_norm_epsilon",
        "norm_eps",
        "eps",
        "norm_epsilon",
        "rope_theta",
        "theta",
        "rope_base",
    }
)


def config_number_problems(obj: object, file: str) -> list[str]:
    """Every non-finite number in a config (Python's JSON reads ``1e999`` as inf), and every
    field of ``POSITIVE_FIELDS`` that is not a number > 0; named by its dotted path."""
    problems, stack = [], [(obj, "")]
    while stack:
        node, where = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            path = f"{where}.{key}" if where else str(key)
            if isinstance(value, (dict, list)):
                stack.append((value, path))
            elif isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{file}: field `{path}` is {value}; numbers must be finite")
            elif (
                isinstance(node, dict)
                and key in POSITIVE_FIELDS
                and value is not None
                and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0)
            ):
                problems.append(f"{file}: field `{path}` is {short_repr(value)}; it must be a number > 0")
    return problems


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


_F32 = torch.finfo(torch.float32)
E4M3 = torch.float8_e4m3fn  # the codes' dtype (ModelOpt's F8_E4M3)
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448.0, the largest E4M3 magnitude: codes * scale must stay finite in float32
# float32 rounds a real to inf from the midpoint between its largest finite value (2^128 - 2^104)
# and 2^128 up (ties go to the even 2^128). A float32 scale times 448 (= 7 * 2^6) is exact in
# float64, so comparing that product with the midpoint is float32's own ``scale * 448`` overflow,
# without building a tensor per scale (tests/unit/test_value_checks.py covers both sides).
_F32_OVERFLOW = 2.0**128 - 2.0**103


def _check_scale(entry: TensorEntry, problems: list[str], values: dict[str, float]) -> bool:
    """A scale must be one normal, positive F32 with ``448 * scale`` finite; reads only its 4
    bytes (through the held descriptor) and records the value in ``values``. True when it is."""
    if entry.dtype != "F32" or entry.numel != 1:
        problems.append(
            f"`{entry.key}` in {entry.file} must be F32 with exactly one element, got {entry.dtype} shape {entry.shape}"
        )
        return False
    try:
        value = read_scale_value(entry)
    except (OSError, ValueError) as exc:
        problems.append(f"`{entry.key}` in {entry.file}: cannot read the scale: {exc}")
        return False
    if not math.isfinite(value) or value <= 0:
        problems.append(f"`{entry.key}` in {entry.file} is {value}; a scale must be finite and > 0")
        return False
    if value < _F32.tiny:  # dequantizes every code to ~0: a zero layer that looks loaded
        problems.append(
            f"`{entry.key}` in {entry.file} is {value}, a subnormal float32 (below {_F32.tiny}); "
            "a scale must be a normal float32 > 0"
        )
        return False
    if value * E4M3_MAX >= _F32_OVERFLOW:
        problems.append(
            f"`{entry.key}` in {entry.file} is {value}; {E4M3_MAX:g} * scale overflows float32 (max {_F32.max:.6g})"
        )
        return False
    values[entry.key] = value
    return True


def _classify(
    tensors: dict[str, TensorEntry], quant: QuantConfig, config_ok: bool, problems: list[str], values: dict[str, float]
):
    """(FP8 modules, high-precision tensors, KV-cache scales), from the stored dtypes; every
    problem goes to ``problems`` and every scale read to ``values``."""
    f8_weights = _f8_weight_modules(tensors, quant, config_ok, problems)
    if not quant.is_modelopt_fp8:
        return {}, dict(tensors), {}
    fp8 = _fp8_modules(tensors, f8_weights, quant, problems, values)
    kv = _scales_and_foreign(tensors, f8_weights, problems, values)
    _check_kv_config(kv, quant, problems)
    claimed = (
        {m.weight.key for m in fp8.values()}
        | {m.weight_scale.key for m in fp8.values()}
        | {m.input_scale.key for m in fp8.values()}
        | set(kv)
    )
    high = {k: e for k, e in tensors.items() if k not in claimed}
    return fp8, high, kv


def _f8_weight_modules(
    tensors: dict[str, TensorEntry], quant: QuantConfig, config_ok: bool, problems: list[str]
) -> set[str]:
    """The modules whose weight is stored F8_E4M3, even if malformed; F8 stored where it may
    not be (E5M2, no ModelOpt FP8 config, not a linear `.weight`, not 2-D) is a problem."""
    f8_weights: set[str] = set()
    for key, e in sorted(tensors.items()):
        where = f"`{key}` in {e.file}"
        if e.dtype == "F8_E5M2":
            problems.append(f"{where} is F8_E5M2; ModelOpt static FP8 stores F8_E4M3 only")
        elif e.dtype != "F8_E4M3":
            continue
        elif not quant.is_modelopt_fp8:
            if config_ok:
                problems.append(
                    f"{where} is stored as F8_E4M3 but the checkpoint has no ModelOpt FP8 "
                    "quantization config (hf_quant_config.json or config.json quantization_config)"
                )
        elif not key.endswith(".weight"):
            problems.append(f"{where} is F8_E4M3 but is not a linear `.weight`")
        else:
            f8_weights.add(key[: -len(".weight")])
            if len(e.shape) != 2:
                problems.append(f"{where} is an FP8 weight with shape {e.shape}; expected 2-D [out, in]")
    return f8_weights


def _fp8_modules(
    tensors: dict[str, TensorEntry],
    f8_weights: set[str],
    quant: QuantConfig,
    problems: list[str],
    values: dict[str, float],
) -> dict[str, Fp8ModuleEntry]:
    """Each F8 weight with both its valid scales, as one FP8 module entry."""
    fp8: dict[str, Fp8ModuleEntry] = {}
    for module in sorted(f8_weights):
        weight = tensors[f"{module}.weight"]
        scales = {}
        for suffix in _SCALE_SUFFIXES:
            scale = tensors.get(module + suffix)
            if scale is None:
                problems.append(f"`{module}.weight` in {weight.file} is F8_E4M3 but `{module}{suffix}` is missing")
            else:
                scales[suffix] = scale if _check_scale(scale, problems, values) else None
        if len(weight.shape) == 2 and all(scales.get(s) for s in _SCALE_SUFFIXES):
            fp8[module] = Fp8ModuleEntry(
                module, weight, scales[".weight_scale"], scales[".input_scale"], tensors.get(f"{module}.bias")
            )
            if quant.is_ignored(module):
                # The ignore list is advice, the stored dtype decides (docs/checkpoint-format.md).
                logger.warning("`%s` matches the ignore list but is stored as F8_E4M3; loading it as FP8", module)
    return fp8


def _scales_and_foreign(
    tensors: dict[str, TensorEntry], f8_weights: set[str], problems: list[str], values: dict[str, float]
) -> dict[str, TensorEntry]:
    """The KV-cache scales (checked); another ModelOpt mode's tensors and scales without an F8
    weight are problems."""
    kv: dict[str, TensorEntry] = {}
    for key, e in sorted(tensors.items()):
        if key.endswith(_FOREIGN_SUFFIXES):
            problems.append(f"`{key}` in {e.file} belongs to a ModelOpt mode other than static per-tensor FP8")
        elif key.endswith(_SCALE_SUFFIXES):
            module = key.rsplit(".", 1)[0]
            weight = tensors.get(f"{module}.weight")
            if weight is None:
                problems.append(f"`{key}` in {e.file} is a scale without a `{module}.weight`")
            elif module not in f8_weights:
                problems.append(
                    f"`{key}` in {e.file} is a scale for `{module}.weight`, which is stored as "
                    f"{weight.dtype}, not F8_E4M3"
                )
        elif key.endswith(KV_SCALE_SUFFIXES):
            _check_scale(e, problems, values)
            kv[key] = e
    return kv


def _check_kv_config(kv: dict[str, TensorEntry], quant: QuantConfig, problems: list[str]) -> None:
    """KV-cache scales and ``kv_cache_quant_algo`` must agree."""
    if kv and quant.kv_cache_quant_algo is None:
        problems.append(
            f"KV-cache scales {sorted(kv)[:2]}... are present but the quantization config "
            "says kv_cache_quant_algo is null"
        )
    if not kv and quant.kv_cache_quant_algo == "FP8":
        problems.append(
            "the quantization config says kv_cache_quant_algo FP8 but there is no `*.k_scale` / `*.v_scale` tensor"
        )


def _descriptor_problem(count: int) -> str | None:
    """One descriptor per shard is held for the load: make room for them, or say why not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = count + 256  # headroom for everything else the process has open
    if soft == resource.RLIM_INFINITY or need <= soft:
        return None
    if hard == resource.RLIM_INFINITY or need <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        return None
    return (
        f"the checkpoint has {count} shard files, and one descriptor is held per shard, but this "
        f"process may open at most {hard} files (ulimit -n)"
    )


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open and fully validate the checkpoint at ``path`` (a directory or diffusers pipeline root).

    The shards stay open until ``Checkpoint.close()`` (or ``with open_checkpoint(...)``, or
    garbage collection); ``load_model`` closes them when the load fails.
    """
    directory = resolve_directory(path)
    context = f"checkpoint {directory}"
    problems: list[str] = []
    json_files: dict[str, dict] = {}
    config = _read_json(directory, "config.json", problems, json_files) or {}
    hf_quant = _read_json(directory, "hf_quant_config.json", problems, json_files)
    problems += config_number_problems(config, "config.json")
    if hf_quant is not None:
        problems += config_number_problems(hf_quant, "hf_quant_config.json")
    quant = parse_quant_config(hf_quant, config, problems)
    quant_ok = not problems  # a file that could not be read counts as a bad quantization config
    layout = find_layout(directory, problems)
    if layout is None:
        raise_if_problems(problems, context)
    if layout.index is not None:
        json_files[layout.index_file] = layout.index
        problems += config_number_problems(layout.index, layout.index_file)
    too_many = _descriptor_problem(len(layout.files))
    if too_many:
        raise_if_problems(problems + [too_many], context)
    headers: dict[str, Header] = {}
    handles: dict[str, OpenFile] = {}
    for name in layout.files:
        handle = open_regular(directory / name, name, problems)
        if handle is None:
            continue
        handles[name] = handle
        header = read_header(handle, problems, name)
        if header is not None:
            headers[name] = header
    tensors = _collect_tensors(layout, headers, problems)
    values: dict[str, float] = {}
    fp8, high, kv = _classify(tensors, quant, quant_ok, problems, values)
    if problems:
        for handle in handles.values():
            handle.close()
        raise_if_problems(problems, context)
    files = {n: ShardFile(n, h.path, h.size, h.header_sha256) for n, h in sorted(headers.items())}
    return Checkpoint(
        directory,
        config,
        quant,
        files,
        dict(sorted(tensors.items())),
        fp8,
        high,
        kv,
        layout.index_file,
        values,
        json_files,
        handles,
    )
