"""Letting a loaded model go: every storage the load made freed at once, the model refusing to run.

FSDP2 keeps a module and its state in reference cycles, so a dropped model keeps its memory until
Python's cycle collector runs. :func:`release_model` frees the bytes in place: every parameter and
buffer, FP8 codes and scales, FSDP2's padded shards, gathered parameters and all-gather outputs,
and cached activation codes. Each storage is resized to zero bytes, so the bytes go even while
something still references the tensors. Local work, no collective: every rank closes.

On the host :func:`trim_host_heap` (``malloc_trim(0)``) hands glibc's freed blocks back to the OS.

Usage and measurements: docs/usage.md, "Using your own checkpoint and model from Python"
("Letting a model go"); docs/reliability.md, "Guarantees".
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp_fp8.collective.unusable import CLOSED, free_storage, mark_unusable, unusable_reason
from fsdp_fp8.fp8.linear import Float8StaticLinear


def release_model(model: nn.Module) -> bool:
    """Free every storage ``model`` holds on this rank and mark it unusable (its forward raises
    ``ModelUnusableError`` saying it was closed; ``save_checkpoint`` refuses it). Returns
    ``False`` when it was already released (a second call does nothing)."""
    if unusable_reason(model) == CLOSED:
        return False
    for module in model.modules():
        if isinstance(module, Float8StaticLinear):
            module.shared = None  # the group's cached activation codes go with its last member
    held = _fsdp_held(model)
    mark_unusable(model, CLOSED)  # registered parameters and buffers, inner tensors included
    for tensor in held:
        free_storage(tensor)
    trim_host_heap()
    return True


def _fsdp_held(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor FSDP2 holds for the modules of ``model``, whichever state they are in.

    FSDP2's private objects (``FSDPParamGroup``, ``FSDPParam``), read by the names torch 2.13
    gives their attributes; a name another torch lacks is skipped, never an error (the storage
    it would have named is then left to the collector).
    """
    held = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in _param_groups(module._get_fsdp_state()):
            group._all_gather_result = None  # a pending all-gather (its output is also held below)
            for param in group.fsdp_params:
                held += [getattr(param, name, None) for name in _FSDP_PARAM_TENSORS]
                held += [*getattr(param, "all_gather_outputs", ()), *getattr(param, "_unsharded_inner_tensors", ())]
    return [t for t in held if isinstance(t, torch.Tensor)]


def _param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)  # one per mesh (torch 2.13)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


# FSDPParam's tensors: the sharded parameter (a DTensor over the padded shard), the padded shard
# itself, and those held only in some states (absent or None in the others).
_FSDP_PARAM_TENSORS = (
    "sharded_param",
    "_sharded_param_data",
    "_unsharded_param",
    "_sharded_post_forward_param_data",
)


def trim_host_heap() -> bool:
    """Return the C heap's free memory to the OS (glibc's ``malloc_trim(0)``); ``False`` where
    the C library has no such call (musl, macOS)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim():
    try:  # the symbols this process already has: the C library's, without searching for it
        return getattr(ctypes.CDLL(None), "malloc_trim", None)
    except (OSError, TypeError):  # Windows: no handle for the process itself
        return None
