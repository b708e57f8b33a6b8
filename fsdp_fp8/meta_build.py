"""Build a model on the meta device with real buffers, then materialize it on a device.

Parameters go to meta as they are registered and their initializers are skipped (a
Super-class model would otherwise spend minutes filling weights we overwrite). Buffers
stay real: non-persistent ones (rotary ``inv_freq``, ...) are in no checkpoint, and
``to_empty`` would leave garbage in them, so ``materialize`` puts them back. This is the
idea behind accelerate's ``init_empty_weights(include_buffers=False)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

_INIT_FUNCTIONS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
    "sparse_",
)


@contextlib.contextmanager
def meta_init() -> Iterator[None]:
    """Inside this block every new parameter lives on meta; buffers are built for real."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
    nn.Module.register_parameter = register_on_meta
    for name in _INIT_FUNCTIONS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        nn.Module.register_parameter = register
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for module_name, module in model.named_modules():
        for name in module._non_persistent_buffers_set:
            buf = module._buffers.get(name)
            if buf is not None:
                out[f"{module_name}.{name}" if module_name else name] = buf
    return out


def materialize(model: nn.Module, device: torch.device) -> None:
    """``to_empty(device)`` keeping the values of non-persistent buffers built for real."""
    kept = {name: buf.detach().clone() for name, buf in non_persistent_buffers(model).items() if not buf.is_meta}
    model.to_empty(device=device)
    for name, value in kept.items():
        module_name, _, buf_name = name.rpartition(".")
        module = model.get_submodule(module_name)
        module._buffers[buf_name] = value.to(device)


def tensors_on_meta(model: nn.Module) -> list[str]:
    """Names of every parameter, buffer or inner tensor (FP8 codes, scales) still on meta."""
    found = []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        local = getattr(tensor, "_local_tensor", tensor)
        inner = [local]
        if hasattr(local, "__tensor_flatten__"):
            names, _ = local.__tensor_flatten__()
            inner = [getattr(local, n) for n in names]
        if any(t.is_meta for t in inner):
            found.append(name)
    return sorted(found)
