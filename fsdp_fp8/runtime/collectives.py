"""Which all-gather FSDP2 calls on this torch, and a meter of the bytes it sends.

torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single`` (the old name stays as
a deprecated wrapper) and its FSDP2 calls the new name; torch 2.10-2.12 have only
``all_gather_into_tensor``, and their FSDP2 calls that. FSDP2 looks the function up on
``torch.distributed`` at every call, so a wrapper put there sees every parameter all-gather.
The meter wraps each of the two names that exists: on 2.13 the old name's body calls the new
one inside ``torch.distributed.distributed_c10d``, not through ``torch.distributed``, so a call
by either name is counted once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch.distributed as dist

NAMES = ("all_gather_single", "all_gather_into_tensor")
_active = threading.Lock()


def all_gather_name() -> str:
    """The ``torch.distributed`` function FSDP2 calls for its flat all-gather on this torch."""
    return "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def all_gather_into(output, input, group=None, async_op: bool = False):
    """``all_gather_single`` where torch has it, else ``all_gather_into_tensor`` (same contract)."""
    return getattr(dist, all_gather_name())(output, input, group=group, async_op=async_op)


class AllGatherMeter:
    """Records the bytes this rank contributes to each flat all-gather inside a ``with`` block.

    ``sizes`` lists each call's input bytes in issue order (what this rank sends; every rank
    of an FSDP2 mesh sends the same padded amount) and ``bytes`` their sum; ``on_call(n)``
    runs at each call. One meter at a time per process (it patches a module attribute).
    """

    def __init__(self, on_call: Callable[[int], None] | None = None) -> None:
        self.sizes: list[int] = []
        self._on_call = on_call
        self._saved: dict[str, Callable] = {}

    @property
    def bytes(self) -> int:
        return sum(self.sizes)

    def _wrap(self, real: Callable) -> Callable:
        def counting(output, input, *args, **kwargs):
            n = input.numel() * input.element_size()
            self.sizes.append(n)
            if self._on_call is not None:
                self._on_call(n)
            return real(output, input, *args, **kwargs)

        return counting

    def __enter__(self) -> AllGatherMeter:
        if not _active.acquire(blocking=False):
            raise RuntimeError("an AllGatherMeter is already active in this process")
        self._saved = {name: getattr(dist, name) for name in NAMES if hasattr(dist, name)}
        for name, real in self._saved.items():
            setattr(dist, name, self._wrap(real))
        return self

    def __exit__(self, *exc) -> None:
        for name, real in self._saved.items():
            setattr(dist, name, real)
        _active.release()
