"""Fake CUDA on a CPU build, for the fake-CUDA test tier (tests/unit/test_fake_cuda_*.py).

Under ``FakeTensorMode`` a tensor made with ``device="cuda"`` holds no data and runs torch's meta
kernels, which enforce what CUDA's kernels enforce on their operands: ``torch._scaled_mm``'s
layouts (first operand row-major, second column-major), K and N multiples of 16, F32 per-tensor
scales, and one device per op (``FakeTensorDeviceMismatchError``). ``CudaRules`` adds the one
precondition of CUDA's ``_scaled_mm`` that the meta kernel does not check (the bias dtype).

What a CPU build cannot fake: any copy onto the fake device from another (``.to("cuda")``,
``copy_`` from a CPU tensor, ``empty_like(..., device="cuda")``: "PyTorch is not linked with
support for cuda devices"), a few tensor methods whose Python bindings take a CUDA device
guard (``copy_`` and ``contiguous`` are routed to their aten ops by ``TensorMethodsAsOps``;
Python indexing is not, so the tests slice with ``narrow`` / ``select``), inductor's code
generation for CUDA (it writes Triton for a device this build lacks), pinning
(``aten._pin_memory`` has no fake kernel), and data-dependent ops.
``torch.empty_strided(size, stride, dtype=..., device="cuda")``, ``clone`` and the aten ops work.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _pop_mode_temporarily,
    is_traceable_wrapper_subclass,
)

from fsdp_fp8.fp8.linear import Float8StaticLinear

aten = torch.ops.aten


class CudaRules(TorchDispatchMode):
    """The check of CUDA's ``_scaled_mm`` (aten/src/ATen/native/cuda/Blas.cpp, ``_scaled_mm_out_cuda``:
    "Bias must be Float16 to compute Half output" / "Bias must be BFloat16 to compute BFloat16
    output") that ``torch._meta_registrations.meta_scaled_mm`` leaves out; counts the GEMMs."""

    def __init__(self):
        super().__init__()
        self.scaled_mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._scaled_mm.default:
            self.scaled_mm += 1
            bias = kwargs.get("bias", args[4] if len(args) > 4 else None)
            out_dtype = kwargs.get("out_dtype", args[6] if len(args) > 6 else None)
            if bias is not None and bias.dtype != out_dtype:
                raise RuntimeError(f"Bias must be {out_dtype} to compute {out_dtype} output, but got {bias.dtype}")
        return func(*args, **kwargs)


class TensorMethodsAsOps(TorchFunctionMode):
    """``Tensor.copy_`` and ``Tensor.contiguous`` as the aten ops they call.

    On a CPU build the Python bindings of these two methods take a CUDA device guard before they
    dispatch, and there is none ("PyTorch is not linked with support for cuda devices"), while
    the ops themselves run on fake CUDA tensors. FSDP2 copies each rank's rows into its padded
    shard with ``copy_``; TorchAO makes an input row-major with ``contiguous()``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_:
            return aten.copy_.default(*args, **kwargs)
        if func is torch.Tensor.contiguous and not kwargs and len(args) == 1:
            t = args[0]
            return t if t.is_contiguous() else aten.clone.default(t, memory_format=torch.contiguous_format)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_cuda():
    """A fake mode (refusing real tensors: a CPU tensor left in a CUDA model shows) with ``CudaRules``
    inside it; yields the rules (``.scaled_mm`` counts the GEMMs that ran)."""
    rules = CudaRules()
    with FakeTensorMode(), rules, TensorMethodsAsOps():
        yield rules


def on_fake_cuda(t: torch.Tensor) -> torch.Tensor:
    """A fake CUDA tensor with ``t``'s shape, strides and dtype (a subclass rebuilt from its inner
    tensors, each with its own strides); call inside ``fake_cuda()``."""
    if is_traceable_wrapper_subclass(t):
        names, ctx = t.__tensor_flatten__()
        inner = {n: on_fake_cuda(getattr(t, n)) for n in names}
        return type(t).__tensor_unflatten__(inner, ctx, t.shape, t.stride())
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")


@contextlib.contextmanager
def fused_traced_not_generated(kernels_module):
    """``kernels._fused`` through dynamo with ``backend="aot_eager"`` for this block: the same
    functions, traced with ``fullgraph=True, dynamic=True`` on fake CUDA inputs (inductor's CUDA
    code generation is what a CPU build cannot fake). Restored on exit."""
    original = kernels_module._fused

    @functools.cache
    def traced(fn):
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)

        def call(*args):
            # dynamo traces nothing under a user dispatch mode: step out of CudaRules (the
            # compiled functions make no GEMM), keep the fake mode below it.
            if isinstance(_get_current_dispatch_mode(), CudaRules):
                with _pop_mode_temporarily():
                    return compiled(*args)
            return compiled(*args)

        return call

    kernels_module._fused = traced
    torch._dynamo.reset()  # count this block's graphs only (dynamo caches per code object)
    try:
        yield
    finally:
        kernels_module._fused = original
        torch._dynamo.reset()


# --- FSDP2 over static-FP8 linears on a fake CUDA mesh (tests/unit/test_fake_cuda_fsdp.py) ------


IN = 32
ROWS = {"up": 7 * 16, "down": IN, "gate": 16}  # 112, 32 and 16 rows: uneven over 3 and 8 ranks
SMALL = {"tiny": 1}  # one row: ranks >= 1 hold none


class _FP8Block(nn.Module):
    def __init__(self, rows: dict[str, int]):
        super().__init__()
        for name, n in rows.items():
            self.add_module(name, Float8StaticLinear(IN, n, name == "up", torch.bfloat16, device="cuda"))


class FakeMeshModel(nn.Module):
    """Two blocks of static-FP8 linears on fake CUDA, rows uneven over 3 and 8 ranks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_FP8Block(ROWS), _FP8Block(SMALL)])


def gather_unsharded(fsdp_params, group) -> None:
    """FSDP2's ``foreach_all_gather`` then ``foreach_all_gather_copy_out``, without their streams."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as c

    inputs = c._get_param_all_gather_inputs(fsdp_params)
    dtypes, numels, dtype = c._get_all_gather_input_metadatas(inputs)
    flat = [t.view(torch.uint8) for ts in inputs for t in ts]
    sizes = [t.numel() for t in flat]
    world, rank = group.size(), group.rank()
    out = torch.empty(sum(sizes) * world, dtype=dtype, device="cuda")
    inp, out = torch.ops.fsdp.all_gather_copy_in(flat, out, sizes, sum(sizes), rank)
    dist.all_gather_into_tensor(out, inp, group=group)
    c.foreach_all_gather_copy_out(c.AllGatherResult(out, None, None, dtypes, numels, sizes), fsdp_params, group)
    for p in fsdp_params:
        p.init_unsharded_param()
        p.to_unsharded()
