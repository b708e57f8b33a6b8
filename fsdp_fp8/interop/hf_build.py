"""Build Hugging Face transformers / diffusers models from a checkpoint's ``config.json``.

Both libraries are optional (``pip install 'fsdp_fp8[hf]'``) and imported only here, only
when a checkpoint asks for one of their classes: ``import fsdp_fp8`` never imports them.
The model is built from its config alone, never from the hub, under ``meta_init`` in the
caller: parameters on meta, buffers (rotary ``inv_freq``, ...) computed for real.

dtype: a transformers config records it (``dtype``, or the older ``torch_dtype``) and the
model is built in it, as ``from_pretrained`` would. A diffusers ``config.json`` does not (nor
does an old transformers one), so the dtype is the one most of the checkpoint's
high-precision elements are stored in, which
is what a user passes as ``torch_dtype``; modules in the class's ``_keep_in_fp32_modules``
stay float32, as diffusers keeps them.
"""

from __future__ import annotations

import importlib
import logging
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.format.handles import short_repr
from fsdp_fp8.third_party import quiet_imports

log = logging.getLogger(__name__)

EXTRA = "pip install 'fsdp_fp8[hf]'"

# config.json keys that describe the stored bytes, not the model: a transformers config
# carrying `quantization_config` makes from_config look for an HF quantizer.
_NOT_MODEL_CONFIG = ("quantization_config",)


def _import(package: str, class_name: str, source: str):
    try:
        with quiet_imports():  # diffusers and transformers import their modules lazily, on getattr
            module = importlib.import_module(package)
            cls = getattr(module, class_name, None)
    except ImportError as exc:
        raise ArgumentError(
            f"{source}: model class {class_name!r} comes from {package}, which is not installed "
            f"({exc}); install the extra: {EXTRA}"
        ) from exc
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise ArgumentError(
            f"{source}: {package} {getattr(module, '__version__', '?')} has no model class {class_name!r}; "
            f"a newer {package} may (the tested versions are in {EXTRA})"
        )
    return cls


def _dtype(value: object, source: str, field: str) -> torch.dtype:
    dtype = getattr(torch, value, None) if isinstance(value, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ArgumentError(f"{source}: field `{field}` is {value!r}, not a floating-point torch dtype")
    return dtype


def stored_dtype(checkpoint) -> torch.dtype | None:
    """The floating dtype most high-precision elements of ``checkpoint`` are stored in."""
    counts: Counter = Counter()
    for entry in checkpoint.high_precision.values():
        if entry.torch_dtype.is_floating_point:
            counts[entry.torch_dtype] += entry.numel
    return counts.most_common(1)[0][0] if counts else None


def _report_auto_map(config: dict, source: str) -> None:
    # The class always comes from the library itself (by name), never from the checkpoint.
    if config.get("auto_map"):
        log.warning(
            "%s: `auto_map` names custom code %s; fsdp_fp8 never runs it (ignored)",
            source,
            short_repr(config["auto_map"]),
        )


def transformers_model_fn(
    config: dict, source: str, stored: torch.dtype | None = None
) -> tuple[str, Callable[[dict], nn.Module], torch.dtype]:
    """(class name, model_fn, dtype) for a transformers ``config.json`` with ``architectures``;
    ``stored`` (the checkpoint's dtype) serves when the config records none."""
    names = config.get("architectures")
    if not isinstance(names, list) or len(names) != 1 or not isinstance(names[0], str):
        raise ArgumentError(f"{source}: field `architectures` must name exactly one model class, got {names!r}")
    class_name = names[0]
    if not isinstance(config.get("model_type"), str):
        raise ArgumentError(f"{source}: field `model_type` is missing; cannot build {class_name!r} from this config")
    field = "dtype" if "dtype" in config else "torch_dtype"
    if config.get(field) is not None:
        dtype = _dtype(config[field], source, field)
    else:
        dtype = stored or torch.float32
    _report_auto_map(config, source)
    cls = _import("transformers", class_name, source)

    def build(cfg: dict) -> nn.Module:
        from transformers import AutoConfig

        kwargs = {k: v for k, v in cfg.items() if k not in _NOT_MODEL_CONFIG and k != "model_type"}
        hf_config = AutoConfig.for_model(cfg["model_type"], **kwargs)
        # _from_config, not from_pretrained: nothing is downloaded or read but the config.
        return cls._from_config(hf_config, dtype=dtype)

    return class_name, build, dtype


def diffusers_model_fn(
    config: dict, source: str, dtype: torch.dtype | None
) -> tuple[str, Callable[[dict], nn.Module], torch.dtype]:
    class_name = config["_class_name"]
    _report_auto_map(config, source)
    cls = _import("diffusers", class_name, source)
    dtype = dtype or torch.float32

    def build(cfg: dict) -> nn.Module:
        model = cls.from_config({k: v for k, v in cfg.items() if k not in _NOT_MODEL_CONFIG})
        keep = tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())
        for name, module in model.named_modules():
            if any(part in keep for part in name.split(".")):
                continue
            for key, param in module._parameters.items():
                if param is not None and param.is_floating_point():
                    module._parameters[key] = nn.Parameter(param.to(dtype), requires_grad=param.requires_grad)
            for key, buf in module._buffers.items():
                # Persistent buffers come from the checkpoint in its dtype; non-persistent
                # ones (rotary tables) keep the precision the model computed them in.
                if buf is not None and buf.is_floating_point() and key not in module._non_persistent_buffers_set:
                    module._buffers[key] = buf.to(dtype)
        return model

    return class_name, build, dtype


def is_causal_lm(class_name: str) -> bool:
    return class_name.endswith("ForCausalLM")
