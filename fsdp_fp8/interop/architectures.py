"""Which model class a checkpoint's ``config.json`` asks for, built from that config.

    _class_name == ReferenceMoTTransformer  -> our reference MoT        (kind "mot")
    _class_name == <a diffusers class>      -> diffusers from_config    (kind "diffusers")
    architectures == [<a transformers class>] -> transformers _from_config
                                               (kind "causal_lm" for *ForCausalLM, else "transformers")

transformers and diffusers are optional (``fsdp_fp8[hf]``) and imported by ``fsdp_fp8.interop.hf_build``
only when a checkpoint names one of their classes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.interop import hf_build as hf
from fsdp_fp8.load.spec import ModelSpec, TowerSpec, custom_spec
from fsdp_fp8.models import MoTConfig, build_model, linear_towers
from fsdp_fp8.models.mot_config import CLASS_NAME as MOT_CLASS_NAME
from fsdp_fp8.runtime.towers import cosmos3_towers

# Tower maps of diffusers / transformers classes, by the class name config.json gives
# (fsdp_fp8.runtime.towers); a class not here has none, and a step policy that needs one is
# refused unless the user passes `towers=`.
KNOWN_TOWERS: dict[str, Callable[[nn.Module], dict[str, str]]] = {"Cosmos3OmniTransformer": cosmos3_towers}


def _mot(config: dict) -> nn.Module:
    # Built on the current device: under meta_init parameters land on meta while the RoPE
    # buffer is computed for real.
    return build_model(MoTConfig.from_config_dict(config), device="cpu")


def model_spec(model_fn: Callable[[dict], nn.Module] | None, checkpoint, towers: TowerSpec | None = None) -> ModelSpec:
    """What a load builds: the caller's ``model_fn`` (its tower map: ``towers``, else the one of
    the class it builds, ``known_towers``), or with ``model_fn=None`` the class the opened
    ``checkpoint``'s ``config.json`` names (``resolve_model_spec``; ``towers`` overrides its map)."""
    if model_fn is not None:
        return custom_spec(model_fn, towers if towers is not None else class_towers)
    spec = resolve_model_spec(checkpoint.config, f"{checkpoint.directory}/config.json", checkpoint)
    return spec if towers is None else ModelSpec(spec.name, spec.kind, spec.model_fn, towers, spec.dtype)


def resolve_model_spec(config: dict, source: str = "config.json", checkpoint=None) -> ModelSpec:
    """The model a checkpoint's config names; ``checkpoint`` (opened) supplies the dtype a
    config does not record (always so for diffusers).

    Raises ``ValueError`` naming the class when it is unknown, or when its library is
    missing (with the extra to install).
    """
    class_name = config.get("_class_name")
    if class_name == MOT_CLASS_NAME:
        return ModelSpec(MOT_CLASS_NAME, "mot", _mot, linear_towers)
    stored = hf.stored_dtype(checkpoint) if checkpoint is not None else None
    if isinstance(class_name, str):
        name, fn, dtype = hf.diffusers_model_fn(config, source, stored)
        return ModelSpec(name, "diffusers", fn, KNOWN_TOWERS.get(name), dtype)
    if "architectures" in config:
        name, fn, dtype = hf.transformers_model_fn(config, source, stored)
        kind = "causal_lm" if hf.is_causal_lm(name) else "transformers"
        return ModelSpec(name, kind, fn, KNOWN_TOWERS.get(name), dtype)
    raise ArgumentError(
        f"{source}: names no model class (no `_class_name`, no `architectures`); pass your own "
        f"model_fn to fsdp_fp8.load_model (this launcher runs {MOT_CLASS_NAME!r}, transformers "
        "and diffusers checkpoints)"
    )


def class_towers(model: nn.Module) -> Mapping[str, str] | None:
    """The tower map of ``model`` by its class (``known_towers``), or ``None`` when it has none."""
    towers = known_towers(model)
    return towers(model) if towers is not None else None


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
