"""Peak bytes of live tensor storage on one device during a block: a CPU stand-in for
``torch.cuda.max_memory_allocated``, used to check the memory forecast where no GPU exists.

Every storage an aten op returns (seen through a ``TorchDispatchMode``), and every storage the
caller registers beforehand (the model's weights), is tracked through a weak reference; after
each op the live total is the sum of the tracked storages' *current* sizes, so FSDP2's
``storage.resize_(0)`` of a resharded parameter counts as freed, as it is. Views share their
storage and count once. Not seen: buffers a kernel allocates internally and frees before it
returns (workspaces), and the allocator's rounding and caching.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    local = getattr(t, "_local_tensor", t)  # a DTensor's shard
    if hasattr(local, "__tensor_flatten__"):  # a tensor subclass: its inner tensors
        inner = [getattr(local, n) for n in local.__tensor_flatten__()[0]]
        return [s for i in inner for s in _storages(i)]
    return [local.untyped_storage()]


class LiveBytes(TorchDispatchMode):
    def __init__(self, device: str = "cpu", baseline: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.device = torch.device(device)
        self._tracked: dict[int, weakref.ref] = {}
        for t in baseline:
            self._track(t)
        self.baseline = self.live()
        self.peak = self.baseline

    def _track(self, t: torch.Tensor) -> None:
        for s in _storages(t):
            if s.device.type == self.device.type and id(s) not in self._tracked:
                key = id(s)
                self._tracked[key] = weakref.ref(s, lambda _ref, key=key: self._tracked.pop(key, None))

    def reset_peak(self) -> int:
        """Start a new phase: the peak from now on (what is live now included); returns it."""
        self.peak = self.live()
        return self.peak

    def live(self) -> int:
        return sum(s.nbytes() for ref in list(self._tracked.values()) if (s := ref()) is not None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        # Inputs too: a storage FSDP2 re-grew with resize_ (not an op) is seen when next used.
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                self._track(t)
        self.peak = max(self.peak, self.live())
        return out


def module_tensors(*modules: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of ``modules``: the baseline a measurement starts from."""
    return [t for m in modules for t in (*m.parameters(), *m.buffers())]
