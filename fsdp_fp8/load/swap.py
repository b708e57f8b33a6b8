"""Replace planned ``nn.Linear``s by static-FP8 linears on the meta device, before ``fully_shard``.

Swapping first means FSDP2 sees the ``PrototypeFloat8Tensor`` extension at wrap time and
``to_empty`` allocates 1 byte per FP8 element: no high-precision copy of an FP8 weight
ever exists.
"""

from __future__ import annotations

from torch import nn

from fsdp_fp8.errors import ArgumentTypeError
from fsdp_fp8.fp8.kernels import DEFAULT_KERNELS, KernelOptions
from fsdp_fp8.fp8.linear import Float8StaticLinear


def swap_fp8_linears(model: nn.Module, plan, kernels: KernelOptions = DEFAULT_KERNELS) -> list[str]:
    """Swap every FP8 target of ``plan`` (a validated ``LoadPlan``) for a ``Float8StaticLinear``
    running ``kernels``; returns the module names."""
    swapped = []
    for target in plan.fp8:
        parent_name, _, child_name = target.module.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child_name)
        if not isinstance(old, nn.Linear):  # the plan validated this; a changed model is a bug
            raise ArgumentTypeError(f"`{target.module}` is {type(old).__name__}, no longer the planned nn.Linear")
        new = Float8StaticLinear(
            target.in_features,
            target.out_features,
            bias=old.bias is not None,
            compute_dtype=target.compute_dtype,
            device=old.weight.device,
            kernels=kernels,
        )
        setattr(parent, child_name, new)
        swapped.append(target.module)
    return swapped
