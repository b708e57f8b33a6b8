"""Which all-gather FSDP2 calls on this torch, and a meter of the bytes it sends.

torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single`` (the old name stays as
a deprecated wrapper) and its FSDP2 calls the new name; torch 2.10-2.12 have only
``all_gather_into_tensor``, and their FSDP2 calls that. Both names issue the same c10d op,
``c10d._allgather_base_``, through the dispatcher, and that op is what the meter counts: a
``TorchDispatchMode`` (the mechanism of torch's own ``CommDebugMode``) sees each call once,
by either name, with nothing of ``torch.distributed`` replaced. ``CommDebugMode`` itself is
not used: entering it also registers process-wide module hooks (its module tracker).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

NAMES = ("all_gather_single", "all_gather_into_tensor")


def all_gather_name() -> str:
    """The ``torch.distributed`` function FSDP2 calls for its flat all-gather on this torch."""
    return "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def all_gather_into(output, input, group=None, async_op: bool = False):
    """``all_gather_single`` where torch has it, else ``all_gather_into_tensor`` (same contract)."""
    return getattr(dist, all_gather_name())(output, input, group=group, async_op=async_op)


def _flat_all_gather():
    """The c10d op behind both names (``(output, input, process_group, async_op, timeout)``)."""
    return torch.ops.c10d._allgather_base_.default


class AllGatherMeter(TorchDispatchMode):
    """Records the bytes this rank contributes to each flat all-gather inside a ``with`` block.

    ``sizes`` lists each call's input bytes in issue order (what this rank sends; every rank
    of an FSDP2 mesh sends the same padded amount) and ``bytes`` their sum; ``on_call(n)``
    runs at each call. A dispatch mode: it counts the all-gathers issued by the thread that
    entered it (FSDP2 issues a forward's on the thread running it), and meters nest (each
    counts what runs inside it). Every op of the block passes through its Python
    ``__torch_dispatch__`` (one comparison, then the op): a cost per op, not per byte.
    """

    def __init__(self, on_call: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.sizes: list[int] = []
        self._on_call = on_call
        self._op = _flat_all_gather()

    @property
    def bytes(self) -> int:
        return sum(self.sizes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self._op:
            input = args[1] if len(args) > 1 else kwargs["input_tensor"]
            n = input.numel() * input.element_size()
            self.sizes.append(n)
            if self._on_call is not None:
                self._on_call(n)
        return func(*args, **(kwargs or {}))
