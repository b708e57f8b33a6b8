"""Which model class a checkpoint's ``config.json`` asks for, built from that config.

    _class_name == ReferenceMoTTransformer  -> our reference MoT        (kind "mot")
    _class_name == <a diffusers class>      -> diffusers from_config    (kind "diffusers")
    architectures == [<a transformers class>] -> transformers _from_config
                                               (kind "causal_lm" for *ForCausalLM, else "transformers")

transformers and diffusers are optional (``fsdp_fp8[hf]``) and imported by ``fsdp_fp8.interop.hf_build``
only when a checkpoint names one of their classes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_fp8.interop import hf_build as hf
from fsdp_fp8.models import MoTConfig, build_model, linear_towers
from fsdp_fp8.models.mot_config import CLASS_NAME as MOT_CLASS_NAME
from fsdp_fp8.runtime.towers import cosmos3_towers


@dataclass(frozen=True)
class Architecture:
    name: str
    kind: str  # "mot" | "causal_lm" | "transformers" | "diffusers"
    model_fn: Callable[[dict], nn.Module]
    towers: Callable[[nn.Module], dict[str, str]] | None  # linear name -> tower, for the step policy
    dtype: torch.dtype | None = None  # what an HF model is built in (None: the model decides)


# Tower maps of diffusers / transformers classes, by the class name config.json gives
# (fsdp_fp8.runtime.towers); a class not here has none, and a step policy that needs one is
# refused unless the user passes `towers=`.
KNOWN_TOWERS: dict[str, Callable[[nn.Module], dict[str, str]]] = {"Cosmos3OmniTransformer": cosmos3_towers}


def _mot(config: dict) -> nn.Module:
    # Built on the current device: under meta_init parameters land on meta while the RoPE
    # buffer is computed for real.
    return build_model(MoTConfig.from_config_dict(config), device="cpu")


def resolve_architecture(config: dict, source: str = "config.json", checkpoint=None) -> Architecture:
    """The model a checkpoint's config names; ``checkpoint`` (opened) supplies the dtype a
    config does not record (always so for diffusers).

    Raises ``ValueError`` naming the class when it is unknown, or when its library is
    missing (with the extra to install).
    """
    class_name = config.get("_class_name")
    if class_name == MOT_CLASS_NAME:
        return Architecture(MOT_CLASS_NAME, "mot", _mot, linear_towers)
    stored = hf.stored_dtype(checkpoint) if checkpoint is not None else None
    if isinstance(class_name, str):
        name, fn, dtype = hf.diffusers_model_fn(config, source, stored)
        return Architecture(name, "diffusers", fn, KNOWN_TOWERS.get(name), dtype)
    if "architectures" in config:
        name, fn, dtype = hf.transformers_model_fn(config, source, stored)
        kind = "causal_lm" if hf.is_causal_lm(name) else "transformers"
        return Architecture(name, kind, fn, KNOWN_TOWERS.get(name), dtype)
    raise ValueError(
        f"{source}: names no model class (no `_class_name`, no `architectures`); pass your own "
        f"model_fn to fsdp_fp8.load_model (this launcher runs {MOT_CLASS_NAME!r}, transformers "
        "and diffusers checkpoints)"
    )


def known_towers(model: nn.Module) -> Callable[[nn.Module], dict[str, str]] | None:
    """The tower map of a model built by the user's own ``model_fn``, when its class has one.

    By the class and its bases (``fully_shard`` renames the class to ``FSDP<name>``), before
    or after sharding alike.
    """
    for cls in type(model).__mro__:
        if cls.__name__ == MOT_CLASS_NAME:
            return linear_towers
        if cls.__name__ in KNOWN_TOWERS:
            return KNOWN_TOWERS[cls.__name__]
    return None
