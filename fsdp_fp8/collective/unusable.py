"""A model whose collective phase failed, or that was closed: no module computes again, its
storage is released.

The reason is kept in ``UNUSABLE`` (weakly, on every module), read back
through ``unusable_reason`` by whoever must refuse such a model later (``save_checkpoint``).
"""

from __future__ import annotations

import torch
from torch import nn

from fsdp_fp8.collective.attached import Attachment
from fsdp_fp8.errors import ModelUnusableError

UNUSABLE: Attachment[str] = Attachment("why a model's collective phase failed (every module of it)")


def storage_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``tensor``'s data on this rank: a DTensor's local shard, and a
    tensor subclass's inner tensors (FP8 codes and scales)."""
    local = getattr(tensor, "_local_tensor", tensor)
    if hasattr(local, "__tensor_flatten__"):
        return [getattr(local, n) for n in local.__tensor_flatten__()[0]]
    return [local]


# The reason a closed model carries (``LoadedModel.close``, ``fsdp_fp8.load.release``).
CLOSED = "LoadedModel.close() released its storage; load the checkpoint again to use it"


def unusable_message(reason: str, use: str = "used") -> str:
    """What a refusal says: the model was closed, or its load did not finish, and why."""
    state = "was closed" if reason == CLOSED else "did not finish loading"
    return f"this model {state} and must not be {use}: {reason}"


def free_storage(tensor: torch.Tensor) -> None:
    """Resize every storage holding ``tensor``'s data on this rank to zero bytes (its views,
    wherever they are held, lose their data too); a storage torch cannot resize is left."""
    for t in storage_tensors(tensor):
        if not t.is_meta:
            try:
                t.untyped_storage().resize_(0)
            except RuntimeError:  # a storage that cannot be resized (not allocated by torch)
                pass


def unusable_reason(model: nn.Module) -> str | None:
    """Why ``model`` must not be used (``mark_unusable``), or ``None``."""
    return UNUSABLE.get(model)


def mark_unusable(model: nn.Module, reason: str) -> None:
    """No module of ``model`` may compute again, and its storage is released.

    Every module (not only the root: a submodule called directly would compute on partly
    filled weights) refuses both ``module(...)`` and ``module.forward(...)``; the refusal is
    a prepended pre-hook so it runs before FSDP2's own (lazy init, then an all-gather with
    peers that may be gone), and ``forward`` is shadowed on each instance (the one attribute
    fsdp_fp8 sets on another library's object: a direct ``forward()`` call bypasses every
    hook, and nothing else stops it computing on released storage). Parameters and buffers, FP8 codes and scales included, have their
    storage resized to zero: nothing half-loaded stays in memory.
    """
    message = unusable_message(reason)

    def refuse_hook(module, args):
        raise ModelUnusableError(message)

    def refuse(*args, **kwargs):
        raise ModelUnusableError(message)

    for module in model.modules():
        module.register_forward_pre_hook(refuse_hook, prepend=True)
        module.forward = refuse
        UNUSABLE.set(module, reason)
    for tensor in [*model.parameters(), *model.buffers()]:
        free_storage(tensor)
