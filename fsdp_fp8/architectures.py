"""Which model class a checkpoint's ``config.json`` asks for, built from that config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from fsdp_fp8.models import MoTConfig, build_model, linear_towers
from fsdp_fp8.models.mot_config import CLASS_NAME as MOT_CLASS_NAME


@dataclass(frozen=True)
class Architecture:
    name: str
    kind: str  # "mot": the reference denoiser, sampled by the launcher
    model_fn: Callable[[dict], nn.Module]
    towers: Callable[[nn.Module], dict[str, str]] | None  # linear name -> tower, for the step policy


def _mot(config: dict) -> nn.Module:
    # Built on the current device: under meta_init parameters land on meta while the RoPE
    # buffer is computed for real.
    return build_model(MoTConfig.from_config_dict(config), device="cpu")


def resolve_architecture(config: dict, source: str = "config.json") -> Architecture:
    class_name = config.get("_class_name")
    if class_name == MOT_CLASS_NAME:
        return Architecture(MOT_CLASS_NAME, "mot", _mot, linear_towers)
    named = class_name or (config.get("architectures") or [None])[0]
    raise ValueError(
        f"{source}: unknown model class {named!r}; this launcher runs {MOT_CLASS_NAME!r} checkpoints "
        "(load other models from Python with fsdp_fp8.load_model and your own model_fn)"
    )
