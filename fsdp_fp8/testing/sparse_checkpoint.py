"""Write a full-size ModelOpt static-FP8 checkpoint of the reference MoT that costs no disk.

Headers, index and configs are real (the writer ``export_fp8`` uses, planned for that model);
tensor data regions are left as holes, so a 63B-parameter Super-shaped checkpoint takes a
few megabytes. Scales are written for real (4 bytes each), because opening a checkpoint
reads and checks every scale. With ``fill="random"`` every tensor gets real, seeded data
instead, for small models that a test loads and compares byte for byte.

Used by ``bench/super_dry_run.py`` and ``tests/distributed/test_super_scale.py``: planning, inspection
and the per-rank forecast at full scale, in seconds, without the weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.export.modelopt import DEFAULT_IGNORE
from fsdp_fp8.format.checkpoint import SCALE_SUFFIXES
from fsdp_fp8.format.quant_config import matches_ignore
from fsdp_fp8.format.writer import (
    ShardWriter,
    TensorSpec,
    create_files,
    plan_checkpoint,
    quantization_configs,
    write_index_and_configs,
)
from fsdp_fp8.models import MoTConfig, build_model

WEIGHT_SCALE = 0.01
INPUT_SCALE = 5.0 / 448


def checkpoint_specs(config: MoTConfig, ignore=DEFAULT_IGNORE) -> list[TensorSpec]:
    """The keys, shapes and dtypes ``export_fp8`` would write for ``config``."""
    model = build_model(config, device="meta")
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not matches_ignore(n, ignore)}
    out = []
    for key, t in model.state_dict().items():
        module = key.rpartition(".")[0]
        if module in linears and key.endswith(".weight"):
            out.append(TensorSpec(key, torch.float8_e4m3fn, tuple(t.shape)))
            out += [TensorSpec(module + suffix, torch.float32, ()) for suffix in SCALE_SUFFIXES]
        else:
            out.append(TensorSpec(key, t.dtype, tuple(t.shape)))
    return out


def _random(spec: TensorSpec, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + sum(spec.key.encode()))
    values = torch.randn(spec.shape, generator=gen)
    if spec.dtype == torch.float8_e4m3fn:
        values = (values * 64).clamp(-448, 448)
    return values.to(spec.dtype)


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
        raise ArgumentError(f"fill must be 'holes' or 'random', got {fill!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if any(directory.iterdir()):
        raise FileExistsError(f"{directory} is not empty")
    specs = checkpoint_specs(config, ignore)
    layout = plan_checkpoint(specs, max_shard_size=max_shard_size)
    create_files(directory, layout)
    with ShardWriter(directory, layout) as writer:
        for spec in specs:
            if spec.key.endswith(SCALE_SUFFIXES):
                value = WEIGHT_SCALE if spec.key.endswith(".weight_scale") else INPUT_SCALE
                writer.write_tensor(spec.key, torch.tensor(value, dtype=torch.float32))
            elif fill == "random" and spec.nbytes:
                writer.write_tensor(spec.key, _random(spec, seed))
    qc, hf_quant = quantization_configs(list(ignore))
    config_json = config.to_config_dict()
    config_json["quantization_config"] = qc
    write_index_and_configs(directory, layout, config_json, hf_quant)
    return directory
