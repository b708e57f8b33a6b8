"""Build a model on the meta device with real buffers, then materialize it on a device.

Parameters go to meta as they are registered and their initializers are skipped (a
Super-class model would otherwise spend minutes filling weights we overwrite; transformers'
own copies of the initializers too), for the calling thread only and only inside the block
(``meta_init``). Buffers
stay real: non-persistent ones (rotary ``inv_freq``, ...) are in no checkpoint, and
``to_empty`` would leave garbage in them, so ``materialize`` puts them back. This is the
idea behind accelerate's ``init_empty_weights(include_buffers=False)``. ``materialize``
also keeps tied parameters tied, which ``to_empty`` alone does not.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Iterator

import torch
from torch import nn

from fsdp_fp8.collective.unusable import storage_tensors  # noqa: F401 - one definition, used here too

_INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)


_inside = threading.local()  # .depth: how deep this thread is in meta_init blocks
_installed = {"count": 0}  # threads inside meta_init now; the wrappers are in place while > 0
_install_lock = threading.Lock()
_originals: dict = {}


def _building_on_meta() -> bool:
    return getattr(_inside, "depth", 0) > 0


def _install() -> None:
    """Put the wrappers in place (the first thread to enter). Each wrapper does the original's
    work unless *its calling thread* is inside ``meta_init``: another thread building a model
    meanwhile gets real, initialized parameters."""
    register = nn.Module.register_parameter
    _originals["register_parameter"] = register

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta" and _building_on_meta():
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    def skipping(fn):
        @functools.wraps(fn)
        def init(tensor, *args, **kwargs):
            return tensor if _building_on_meta() else fn(tensor, *args, **kwargs)

        return init

    nn.Module.register_parameter = register_on_meta
    for name in _INIT_FUNCTIONS:
        _originals[name] = getattr(nn.init, name)
        setattr(nn.init, name, skipping(_originals[name]))
    hf = _transformers_init_functions()
    for name in _INIT_FUNCTIONS:
        if name in hf:
            _originals[("transformers", name)] = hf[name]
            hf[name] = skipping(hf[name])


def _uninstall() -> None:
    nn.Module.register_parameter = _originals.pop("register_parameter")
    for name in _INIT_FUNCTIONS:
        setattr(nn.init, name, _originals.pop(name))
    hf = _transformers_init_functions()
    for name in _INIT_FUNCTIONS:
        if ("transformers", name) in _originals:
            hf[name] = _originals.pop(("transformers", name))


def _transformers_init_functions() -> dict:
    """transformers' own copy of the ``nn.init`` initializers (``TORCH_INIT_FUNCTIONS``, taken
    when it was imported: its ``_init_weights`` calls those, so wrapping ``nn.init`` alone
    does not skip them, and each ``normal_`` on a meta tensor runs torch's Python reference
    decomposition, ~1 ms apiece); empty when transformers is not imported (never imported here)."""
    module = sys.modules.get("transformers.initialization")
    table = getattr(module, "TORCH_INIT_FUNCTIONS", None)
    return table if isinstance(table, dict) else {}


@contextlib.contextmanager
def meta_init() -> Iterator[None]:
    """Inside this block every new parameter this thread makes lives on meta and its
    initializer is skipped; buffers are built for real.

    Scoped to the block and to the calling thread: ``nn.Module.register_parameter`` and the
    ``nn.init`` initializers are wrapped only while some thread is inside a ``meta_init`` block
    (the originals are back when the last one leaves), and the wrappers act only for threads
    inside one.
    """
    with _install_lock:
        if _installed["count"] == 0:
            _install()
        _installed["count"] += 1
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        yield
    finally:
        _inside.depth -= 1
        with _install_lock:
            _installed["count"] -= 1
            if _installed["count"] == 0:
                _uninstall()


def non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for module_name, module in model.named_modules():
        for name in module._non_persistent_buffers_set:
            buf = module._buffers.get(name)
            if buf is not None:
                out[f"{module_name}.{name}" if module_name else name] = buf
    return out


def shared_parameters(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module name, parameter name) that hold one parameter object, owner first."""
    groups: dict[int, list[tuple[str, str]]] = {}
    seen: set[tuple[int, str]] = set()
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is None or (id(module), name) in seen:
                continue
            seen.add((id(module), name))
            groups.setdefault(id(param), []).append((module_name, name))
    return [group for group in groups.values() if len(group) > 1]


def _retie(model: nn.Module, groups: list[list[tuple[str, str]]]) -> None:
    for (owner, name), *aliases in groups:
        param = model.get_submodule(owner)._parameters[name]
        for module_name, alias in aliases:
            model.get_submodule(module_name)._parameters[alias] = param


def materialize(model: nn.Module, device: torch.device) -> None:
    """``to_empty(device)`` keeping non-persistent buffer values and tied parameters.

    ``to_empty`` wraps each new tensor in a fresh ``Parameter`` per (module, name), so a
    weight shared by two modules (Hugging Face ``tie_word_embeddings``: ``lm_head.weight is
    embed_tokens.weight``) would come out as two unrelated tensors, only one of them in the
    checkpoint. The sharing is recorded before and restored after, keeping the first owner
    in ``named_modules`` order: the one FSDP2 treats as the primary owner.
    """
    kept = {name: buf.detach().clone() for name, buf in non_persistent_buffers(model).items() if not buf.is_meta}
    ties = shared_parameters(model)
    model.to_empty(device=device)
    for name, value in kept.items():
        module_name, _, buf_name = name.rpartition(".")
        module = model.get_submodule(module_name)
        module._buffers[buf_name] = value.to(device)
    _retie(model, ties)


def buffers_to(model: nn.Module, device: torch.device) -> None:
    """Every buffer onto ``device``: under CPU offload FSDP2 keeps the parameters in host memory
    and all-gathers them onto the device, but buffers are not FSDP2's and the forward runs there."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


def build_on_meta(model_fn, config: dict) -> nn.Module:
    """``model_fn(config)`` under ``meta_init``: parameters on meta, buffers computed for real."""
    with meta_init():
        return model_fn(config)


def tensors_on_meta(model: nn.Module) -> list[str]:
    """Names of every parameter, buffer or inner tensor (FP8 codes, scales) still on meta."""
    found = []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if any(t.is_meta for t in storage_tensors(tensor)):
            found.append(name)
    return sorted(found)
