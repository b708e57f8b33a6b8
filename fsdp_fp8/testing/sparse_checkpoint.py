"""Write a full-size ModelOpt static-FP8 checkpoint of the reference MoT that costs no disk.

Headers, index and configs are real (what ``export_fp8`` writes for that model); tensor
data regions are left as holes (``truncate``), so a 63B-parameter Super-shaped checkpoint
takes a few megabytes. Scales are written for real (4 bytes each), because opening a
checkpoint reads and checks every scale. With ``fill="random"`` every tensor gets real,
seeded data instead, for small models that a test loads and compares byte for byte.

Used by ``bench/super_dry_run.py`` and ``tests/test_super_scale.py``: planning, inspection
and the per-rank forecast at full scale, in seconds, without the weights.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from fsdp_fp8.export.modelopt import DEFAULT_IGNORE, plan_shards, quantization_config, is_ignored, producer_version
from fsdp_fp8.models import MoTConfig, build_model

_STEM = "diffusion_pytorch_model"
_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}
WEIGHT_SCALE = 0.01
INPUT_SCALE = 5.0 / 448


def checkpoint_tensors(config: MoTConfig, ignore=DEFAULT_IGNORE) -> dict[str, torch.Tensor]:
    """Meta tensors with the keys, shapes and dtypes ``export_fp8`` would write for ``config``."""
    model = build_model(config, device="meta")
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not is_ignored(n, ignore)}
    out = {}
    for key, t in model.state_dict().items():
        module = key.rpartition(".")[0]
        if module in linears and key.endswith(".weight"):
            out[key] = torch.empty(t.shape, dtype=torch.float8_e4m3fn, device="meta")
            out[f"{module}.weight_scale"] = torch.empty((), dtype=torch.float32, device="meta")
            out[f"{module}.input_scale"] = torch.empty((), dtype=torch.float32, device="meta")
        else:
            out[key] = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _random_bytes(key: str, t: torch.Tensor, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed + sum(key.encode()))
    values = torch.randn(t.shape, generator=gen)
    if t.dtype == torch.float8_e4m3fn:
        values = (values * 64).clamp(-448, 448)
    return values.to(t.dtype).reshape(-1).view(torch.uint8).numpy().tobytes()


def _write_file(path: Path, tensors: dict[str, torch.Tensor], fill: str, seed: int) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key in sorted(tensors):
        t = tensors[key]
        dtype = _SAFETENSORS_DTYPES[t.dtype]
        header[key] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + _nbytes(t)]}
        offset += _nbytes(t)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
    start = 8 + len(raw)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(start + offset)  # the data region: one hole, no blocks allocated
        for key in sorted(tensors):
            begin = start + header[key]["data_offsets"][0]
            if key.endswith(".weight_scale") or key.endswith(".input_scale"):
                value = WEIGHT_SCALE if key.endswith(".weight_scale") else INPUT_SCALE
                os.pwrite(f.fileno(), struct.pack("<f", value), begin)
            elif fill == "random" and _nbytes(tensors[key]):
                os.pwrite(f.fileno(), _random_bytes(key, tensors[key], seed), begin)


def write_sparse_checkpoint(
    config: MoTConfig,
    directory: str | os.PathLike,
    *,
    max_shard_size: int = 5 << 30,
    fill: Literal["holes", "random"] = "holes",
    seed: int = 0,
    ignore=DEFAULT_IGNORE,
) -> Path:
    """Write the checkpoint ``export_fp8`` would write for ``config`` into an empty ``directory``."""
    if fill not in ("holes", "random"):
        raise ValueError(f"fill must be 'holes' or 'random', got {fill!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if any(directory.iterdir()):
        raise FileExistsError(f"{directory} is not empty")
    tensors = checkpoint_tensors(config, ignore)
    shards = plan_shards(tensors, max_shard_size, False)
    weight_map = {}
    for i, keys in enumerate(shards, start=1):
        name = f"{_STEM}-{i:05d}-of-{len(shards):05d}.safetensors"
        _write_file(directory / name, {k: tensors[k] for k in keys}, fill, seed)
        weight_map.update(dict.fromkeys(keys, name))
    index = {
        "metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())},
        "weight_map": {k: weight_map[k] for k in sorted(weight_map)},
    }
    (directory / f"{_STEM}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config_json = config.to_config_dict()
    config_json["quantization_config"] = quantization_config(list(ignore), None)
    (directory / "config.json").write_text(json.dumps(config_json, indent=4))
    hf_quant = {"producer": {"name": "fsdp_fp8", "version": producer_version()},
                "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": list(ignore)}}
    (directory / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4))
    return directory
