"""Fake CUDA on a CPU-only torch build: run a CUDA code path under CUDA's own preconditions.

Under ``FakeTensorMode`` a tensor made with ``device="cuda"`` runs the meta kernels, which
check what CUDA checks (``_scaled_mm`` layouts, K and N multiples of 16, one device per op)
without a GPU and without data. Two things a CPU build refuses even then, and how this module
gets past them:

- Python indexing (``x[..., a:b]``, ``x[0]``, ``x[None]``, ``x[:n] = y``) and
  ``Tensor.copy_`` of a fake CUDA tensor fail with "PyTorch is not linked with support for cuda
  devices": those hand-written Python bindings open a CUDA device guard before dispatching.
  ``NoDeviceGuard`` re-expresses basic indices (ints, slices, ``None``, ``...``) as the same
  ``select`` / ``slice`` / ``unsqueeze`` views and ``copy_`` as ``aten.copy_``, which dispatch
  without a guard. Tensor and boolean indices are data-dependent and stay refused.
- ``.to("cuda")`` of a CPU tensor fails the same way: ``placed`` makes a fake CUDA tensor of
  the same size, stride and dtype instead (its values are never read under the mode).

What stays out of reach (no data, no device): values and their comparisons, timing, the
profiler's kernels, ``torch.compile`` for CUDA (inductor needs triton and a device), pinned
memory, file reads into device memory, and anything a subprocess runs.
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode


def _basic(index) -> tuple | None:
    """``index`` as a tuple when every part is an int, a slice, None or one Ellipsis."""
    parts = index if isinstance(index, tuple) else (index,)
    for part in parts:
        if isinstance(part, bool) or not (part is None or part is Ellipsis or isinstance(part, (int, slice))):
            return None
        if isinstance(part, slice) and not all(
            v is None or isinstance(v, int) for v in (part.start, part.stop, part.step)
        ):
            return None
    if sum(part is Ellipsis for part in parts) > 1:
        return None
    return parts


def basic_getitem(x: torch.Tensor, parts: tuple) -> torch.Tensor:
    """``x[parts]`` for basic indices, through views only (what torch's indexing returns)."""
    real = sum(1 for p in parts if p is not None and p is not Ellipsis)
    if real > x.dim():
        raise IndexError(f"too many indices for tensor of dimension {x.dim()}")
    expanded: list = []
    for part in parts:
        expanded.extend([slice(None)] * (x.dim() - real) if part is Ellipsis else [part])
    out, dim = x, 0
    for part in expanded:
        if part is None:
            out = out.unsqueeze(dim)
            dim += 1
        elif isinstance(part, int):
            out = out.select(dim, part)
        else:
            start, stop, step = part.indices(out.shape[dim])
            if step <= 0:
                raise ValueError("step must be greater than zero")
            out = torch.ops.aten.slice.Tensor(out, dim, start, max(start, stop), step)
            dim += 1
    return out


class NoDeviceGuard(TorchFunctionMode):
    """Basic indexing and ``copy_`` without the bindings' device guard (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and not kwargs:
            parts = _basic(args[1])
            if parts is not None:
                return basic_getitem(args[0], parts)
        elif func is torch.Tensor.__setitem__ and not kwargs:
            parts = _basic(args[1])
            if parts is not None:
                view, value = basic_getitem(args[0], parts), args[2]
                if isinstance(value, torch.Tensor):
                    torch.ops.aten.copy_.default(view, value)
                else:
                    torch.ops.aten.fill_.Scalar(view, value)
                return None
        elif func is torch.Tensor.copy_:
            return torch.ops.aten.copy_.default(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_cuda():
    """Fake CUDA tensors for the block: ``torch.empty(..., device="cuda")`` and friends work.

    Real tensors met inside (meta parameters, CPU tables) are turned into fakes on their own
    device, so a device mix still fails as it would on a GPU.
    """
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, NoDeviceGuard():
        yield mode


def placed(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: a copy on a real device, a fake of the same layout on a fake one."""
    from torch._subclasses.fake_tensor import FakeTensor, maybe_get_fake_mode

    if maybe_get_fake_mode(t) is None and not isinstance(t, FakeTensor) and _fake_active():
        return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device=device)
    return t.to(device)


def _fake_active() -> bool:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())
