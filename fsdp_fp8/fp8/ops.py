"""The aten ops FSDP2 runs on a ``StaticFloat8Tensor``, in one table, registered on import
through TorchAO's own API (``StaticFloat8Tensor.implements``).

FSDP2 shards, pads, unpads and materializes a parameter with ordinary aten ops. The subclass
inherits TorchAO 0.18's op table; :data:`FSDP_OPS` holds the ops where TorchAO's entry fails on a
static tensor, or is missing (the comment on each says how), :data:`OFFLOAD_OPS` those of FSDP2's
CPU offload, and :data:`FAST_OPS` cheaper entries, with the same results, for two that FSDP2 runs
on every parameter. Our entries live in the subclass's table only: TorchAO's own class is left as
TorchAO made it. tests/distributed/test_fsdp_ops.py tests every entry.

Design: docs/design.md, "An FP8 weight, sharded, padded and gathered" ("Its op table").
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing
from torchao.prototype.quantization.float8_static_quant.prototype_float8_tensor import (
    PrototypeFloat8Tensor,
)

from fsdp_fp8.errors import ArgumentTypeError
from fsdp_fp8.fp8.tensor import E4M3, StaticFloat8Tensor, rebuild

aten = torch.ops.aten


# A view's wrapper must share its source's storage, as return_and_correct_aliasing arranges
# for a view op; for the view ops below the alias is always (input 0 -> every output), so it
# is set directly instead of re-deriving the op's alias schema on every call.
_alias = torch._functionalize_unsafe_set


def _view_of(self: StaticFloat8Tensor, codes: torch.Tensor) -> StaticFloat8Tensor:
    out = rebuild(self, codes)
    _alias(out, self)
    return out


def _split(func, types, args, kwargs):
    self, size = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    views = [rebuild(self, q) for q in self.qdata.split(size, dim)]
    for view in views:
        _alias(view, self)
    return views


def _slice(func, types, args, kwargs):
    self = args[0]
    dim, start, end, step = (*args[1:], *(0, None, None, 1)[len(args) - 1 :])[:4]
    codes = self.qdata
    if kwargs or step != 1 or start is None or end is None or end < 0 or not 0 <= start <= codes.shape[dim]:
        return _view_of(self, func(codes, *args[1:], **kwargs))
    # narrow() (what FSDP2 calls) through the tensor method, cheaper than the op overload.
    return _view_of(self, codes.narrow(dim, start, max(0, min(end, codes.shape[dim]) - start)))


def _view(func, types, args, kwargs):
    return _view_of(args[0], args[0].qdata.view(args[1]))


def _as_strided(func, types, args, kwargs):
    return _view_of(args[0], args[0].qdata.as_strided(*args[1:], **kwargs))


def _detach(func, types, args, kwargs):
    return _view_of(args[0], args[0].qdata.detach())


def _copy(func, types, args, kwargs):
    """copy_ from a static tensor of the same shape: codes and both scales, as TorchAO's does."""
    self, src = args[0], args[1]
    if kwargs or not (type(self) is type(src) is StaticFloat8Tensor and self.shape == src.shape):
        return _TORCHAO[aten.copy_.default](func, types, args, kwargs)
    # The aten op, not Tensor.copy_: on a CPU build that method's Python binding wants a CUDA
    # device guard, so a fake CUDA tensor (tests/unit/test_fake_cuda_fsdp.py) could not be copied.
    aten.copy_.default(self.qdata, src.qdata)
    aten.copy_.default(self.scale, src.scale)
    aten.copy_.default(self.act_quant_scale, src.act_quant_scale)
    return self


def _scales_on(self: StaticFloat8Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh copies of both scales on ``device`` (left unfilled on meta)."""
    scale = torch.empty((1, 1), dtype=torch.float32, device=device)
    act = torch.empty((1, 1), dtype=torch.float32, device=device)
    if not (scale.is_meta or self.scale.is_meta):
        aten.copy_.default(scale, self.scale)  # the op, as in _copy
        aten.copy_.default(act, self.act_quant_scale)
    return scale, act


def _new_sized(func, types, args, kwargs):
    """new_zeros / new_empty(size): fresh codes, the scales copied along."""
    self = args[0]
    device = kwargs.get("device") or self.qdata.device
    # The wrapper's dtype is the compute dtype; a requested dtype never reaches the codes.
    if torch.device(device).type == "meta":  # no bytes to zero: skip new_zeros' Python meta kernel
        qdata = torch.empty(args[1], dtype=E4M3, device=device)
    else:
        new = self.qdata.new_zeros if func is aten.new_zeros.default else self.qdata.new_empty
        qdata = new(args[1], dtype=E4M3, device=device)
    scale, act = _scales_on(self, device)
    return rebuild(self, qdata, scale=scale, act_quant_scale=act)


def _empty_like(func, types, args, kwargs):
    self = args[0]
    device = kwargs.get("device") or self.qdata.device
    qdata = torch.empty_like(self.qdata, dtype=E4M3, device=device)
    scale, act = _scales_on(self, device)
    return rebuild(self, qdata, scale=scale, act_quant_scale=act)


def _to_copy(func, types, args, kwargs):
    """Moves devices; a dtype only changes the compute dtype, never the E4M3 payload."""
    self = args[0]
    device = kwargs.get("device") or self.qdata.device
    dtype = kwargs.get("dtype") or self.dtype
    if not dtype.is_floating_point or dtype.itemsize == 1:
        raise ArgumentTypeError(f"cannot cast a static FP8 weight to {dtype}; its codes stay E4M3")
    # non_blocking passes through: FSDP2's CPU offload copies each pinned shard to the device
    # with non_blocking=True before every all-gather (FSDPParam.all_gather_inputs).
    non_blocking = bool(kwargs.get("non_blocking", False))
    moved = rebuild(
        self,
        self.qdata.to(device, non_blocking=non_blocking),
        scale=self.scale.to(device, non_blocking=non_blocking),
        act_quant_scale=self.act_quant_scale.to(device, non_blocking=non_blocking),
        dtype=dtype,
    )
    return return_and_correct_aliasing(func, args, kwargs, moved)


def _inner(self: StaticFloat8Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return self.qdata, self.scale, self.act_quant_scale


def _is_pinned(func, types, args, kwargs):
    """Pinned when the codes and both scales are: a non_blocking copy of one pageable scale
    would be synchronous."""
    return all(func(t, *args[1:], **kwargs) for t in _inner(args[0]))


def _pin_memory(func, types, args, kwargs):
    """Page-locked copies of the codes and both scales (``Tensor.pin_memory`` asks ``is_pinned``
    first, so a pinned weight is never copied again)."""
    self = args[0]
    codes, scale, act = (func(t, *args[1:], **kwargs) for t in _inner(self))
    return rebuild(self, codes, scale=scale, act_quant_scale=act)


# op -> our entry. Each is needed: TorchAO 0.18's entry fails on a static tensor as noted.
FSDP_OPS = {
    # torch.chunk in fully_shard. TorchAO's unpacks (self, size, dim) and FSDP2's call leaves
    # dim at its default; it also splits block_size in place by the wrong count.
    aten.split.Tensor: _split,
    # narrow() to a rank's rows of the padded shard: TorchAO's returns the base class.
    aten.slice.Tensor: _slice,
    # view(-1), FSDP2's flat handle on the padded shard: TorchAO's reshapes 2-D <-> 3-D only.
    aten.view.default: _view,
    # unpadding the gathered rows in the all-gather copy-out: none in TorchAO.
    aten.as_strided.default: _as_strided,
    # the padded shard, and a rank past the last chunk: none in TorchAO.
    aten.new_zeros.default: _new_sized,
    aten.new_empty.default: _new_sized,
    # Module.to_empty: none in TorchAO.
    aten.empty_like.default: _empty_like,
    # Module.to(dtype): TorchAO's keeps the old compute dtype (and takes any dtype silently).
    aten._to_copy.default: _to_copy,
}
# op -> our entry for FSDP2's CPU offload, ``fully_shard(offload_policy=CPUOffloadPolicy())``:
# FSDPParam pins each padded shard at init (``padded_sharded_param.pin_memory()``, which asks
# ``is_pinned`` first) and again after to_empty / a reload (``if not local_tensor.is_pinned():
# local_tensor.cpu().pin_memory()``). None in TorchAO (``NotImplementedError: aten.is_pinned``).
# Pinning needs an accelerator: on a CPU-only build these reach the inner tensors' own error.
OFFLOAD_OPS = {
    aten.is_pinned.default: _is_pinned,
    aten._pin_memory.default: _pin_memory,
}
# op -> our entry where TorchAO's is right but slow: its generic path rebuilds the tensor
# through every field and re-derives the op's alias schema, and FSDP2 runs these on every
# parameter (detach for each nn.Parameter, copy_ into the padded shard). Same results: the
# FSDP2 test runs the flow with TorchAO's entry for each and compares the bits.
FAST_OPS = {
    aten.detach.default: _detach,
    aten.copy_.default: _copy,
}


def torchao_table() -> dict:
    """TorchAO's op table for ``PrototypeFloat8Tensor``: a ``KeyError`` if TorchAO moved it."""
    try:
        return PrototypeFloat8Tensor._ATEN_OP_TABLE[PrototypeFloat8Tensor]
    except (AttributeError, KeyError) as e:
        raise KeyError(
            "TorchAO's PrototypeFloat8Tensor has no `_ATEN_OP_TABLE` entry of its own: its op-table "
            "layout changed (fsdp_fp8 was written for torchao 0.18), so StaticFloat8Tensor cannot "
            "inherit its detach/clone/copy_/t or take FSDP2's ops"
        ) from e


def _register() -> None:
    inherited = torchao_table()
    ours = StaticFloat8Tensor._ATEN_OP_TABLE[StaticFloat8Tensor]
    needed = (aten.detach.default, aten.clone.default, aten.copy_.default, aten.t.default)
    missing = sorted(str(op) for op in needed if op not in inherited or ours.get(op) is not inherited[op])
    if missing:
        raise KeyError(f"StaticFloat8Tensor did not inherit TorchAO's entries for {missing}")
    for op, impl in (FSDP_OPS | FAST_OPS | OFFLOAD_OPS).items():
        StaticFloat8Tensor.implements(op)(impl)


_TORCHAO = torchao_table()
_register()
