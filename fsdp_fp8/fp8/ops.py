"""FSDP2 support for TorchAO's ``PrototypeFloat8Tensor`` with per-tensor static scales.

FSDP2 shards a parameter by running ordinary aten ops on it (``torch.chunk`` -> split,
``new_zeros``, ``narrow`` -> slice, ``copy_``, ``view(-1)``, ``as_strided``, ...), and
``to_empty`` / ``.to()`` run ``empty_like`` / ``_to_copy``. TorchAO 0.18 implements some
of these for its own use (and ``split`` reads ``dim`` only positionally, and its block
sizes go wrong for uneven chunks), so we register the ones FSDP2 touches, once, in the
class's op table. Each override applies only to per-tensor tensors (ours); any other
``PrototypeFloat8Tensor`` falls through to TorchAO's original implementation.

The all-gather hooks send ``qdata`` as ``uint8`` (gloo refuses float8 with "Invalid
scalar type", and NCCL takes the same bytes), padded to ``ceil(rows / world)`` rows as
FSDP2 requires of extensions; scales are per tensor and identical on every rank, so they
never travel. See docs/design.md for the picture.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing
from torchao.prototype.quantization.float8_static_quant.prototype_float8_tensor import (
    PrototypeFloat8Tensor,
)

from fsdp_fp8.fp8.tensor import E4M3, is_static_fp8, rebuild
from fsdp_fp8.format.sharding import padded_rows

aten = torch.ops.aten
_INSTALLED = False
TORCHAO_ORIGINALS: dict = {}  # op -> TorchAO's own entry (or None), what a non-static tensor gets


def _table() -> dict:
    tables = getattr(PrototypeFloat8Tensor, "_ATEN_OP_TABLE", {})
    return tables.setdefault(PrototypeFloat8Tensor, {})


def _register(ops, impl) -> None:
    """Put ``impl`` in front of whatever TorchAO had for each op (kept as the fallback)."""
    table = _table()
    for op in ops:
        original = table.get(op)
        TORCHAO_ORIGINALS[op] = original

        def wrapper(func, types, args, kwargs, _original=original):
            if is_static_fp8(args[0]):
                return impl(func, args, kwargs or {})
            if _original is None:
                raise NotImplementedError(f"PrototypeFloat8Tensor: {func} is not implemented")
            return _original(func, types, args, kwargs)

        table[op] = wrapper


def _aliasing(func, args, kwargs, out):
    return return_and_correct_aliasing(func, args, kwargs, out)


# --- views: the result shares codes and scales with its source -------------------------


def _split(func, args, kwargs):
    self, split_size = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    if dim % self.ndim != 0:
        raise NotImplementedError(f"split of a static FP8 weight along dim {dim}; only dim 0")
    pieces = func(self.qdata, split_size, dim)
    return [_aliasing(func, args, kwargs, rebuild(self, q)) for q in pieces]


def _slice(func, args, kwargs):
    self = args[0]
    dim, start, end, step = list(args[1:]) + [0, None, None, 1][len(args) - 1 :]
    dim, start = kwargs.get("dim", dim), kwargs.get("start", start)
    end, step = kwargs.get("end", end), kwargs.get("step", step)
    return _aliasing(func, args, kwargs, rebuild(self, func(self.qdata, dim, start, end, step)))


def _view(func, args, kwargs):
    self, size = args[0], args[1]
    return _aliasing(func, args, kwargs, rebuild(self, func(self.qdata, size)))


def _as_strided(func, args, kwargs):
    self = args[0]
    return _aliasing(func, args, kwargs, rebuild(self, func(self.qdata, *args[1:], **kwargs)))


# --- allocations: new codes, the scales travel along (copied, so no aliasing) -------------


def _new_like(func, args, kwargs):
    """new_zeros / new_empty(size) and empty_like / zeros_like: fresh codes, scales copied."""
    self = args[0]
    device = kwargs.get("device") or self.qdata.device
    if func in (aten.new_zeros.default, aten.new_empty.default):
        qdata = func(self.qdata, args[1], dtype=E4M3, device=device)
    else:
        qdata = func(self.qdata, dtype=E4M3, device=device)
    # The wrapper's dtype is the compute dtype; a requested dtype never reaches the codes.
    scale = torch.empty_like(self.scale, device=device)
    act = torch.empty_like(self.act_quant_scale, device=device)
    if not (scale.is_meta or self.scale.is_meta):
        scale.copy_(self.scale)
        act.copy_(self.act_quant_scale)
    return rebuild(self, qdata, scale=scale, act_quant_scale=act)


def _to_copy(func, args, kwargs):
    """Moves devices; a dtype only changes the compute dtype, never the E4M3 payload."""
    self = args[0]
    device = kwargs.get("device") or self.qdata.device
    dtype = kwargs.get("dtype") or self.dtype
    if not dtype.is_floating_point or dtype.itemsize == 1:
        raise TypeError(f"cannot cast a static FP8 weight to {dtype}; its codes stay E4M3")
    moved = rebuild(
        self,
        self.qdata.to(device),
        scale=self.scale.to(device),
        act_quant_scale=self.act_quant_scale.to(device),
        dtype=dtype,
    )
    return _aliasing(func, args, kwargs, moved)


def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
    """Send this rank's rows of ``qdata`` as bytes, padded to ``ceil(rows / world)`` rows."""
    padded_shape = (padded_rows(outer_size[0], mesh.size()), *outer_size[1:])
    codes = self.qdata
    if tuple(codes.shape) == padded_shape:
        payload = codes.view(torch.uint8)
    else:
        # FSDP2 keeps a rank's rows as a narrow() of a padded buffer after lazy init; reuse
        # that buffer when it is there instead of copying the shard every forward.
        storage = codes.untyped_storage()
        need = math.prod(padded_shape)
        if codes.is_contiguous() and storage.nbytes() - codes.storage_offset() >= need and codes.numel() > 0:
            payload = torch.empty(0, dtype=torch.uint8, device=codes.device).set_(
                storage, codes.storage_offset(), padded_shape
            )
        else:
            payload = torch.zeros(padded_shape, dtype=torch.uint8, device=codes.device)
            if codes.numel() > 0:
                payload[: codes.shape[0]].copy_(codes.view(torch.uint8))
    return (payload,), (tuple(outer_size),)


def fsdp_post_all_gather(
    self,
    all_gather_outputs: tuple[torch.Tensor, ...],
    metadata: Any,
    param_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
):
    """View the gathered bytes back as E4M3 (first ``rows`` rows); reuse ``out`` when given."""
    (gathered,) = all_gather_outputs
    (outer_size,) = metadata
    codes = gathered.view(E4M3)[: outer_size[0]]
    if out is not None:
        if out.qdata.untyped_storage().data_ptr() != codes.untyped_storage().data_ptr():
            out.qdata.copy_(codes)
        return None
    # The compute dtype is the module's, not FSDP's param_dtype: a mixed-precision policy
    # must not turn the dequantized arithmetic into something the checkpoint did not ask for.
    return rebuild(self, codes), (gathered,)


def install_fsdp_support() -> None:
    """Register the ops and hooks; safe to call any number of times."""
    global _INSTALLED
    if _INSTALLED:
        return
    _register([aten.split.Tensor], _split)
    _register([aten.slice.Tensor], _slice)
    _register([aten.view.default], _view)
    _register([aten.as_strided.default], _as_strided)
    _register(
        [aten.new_zeros.default, aten.new_empty.default, aten.empty_like.default, aten.zeros_like.default],
        _new_like,
    )
    _register([aten._to_copy.default], _to_copy)
    PrototypeFloat8Tensor.fsdp_pre_all_gather = fsdp_pre_all_gather
    PrototypeFloat8Tensor.fsdp_post_all_gather = fsdp_post_all_gather
    _INSTALLED = True


# Ops this module registers; TorchAO's own detach, clone, copy_ and t already serve static
# tensors. Tests prove each registered op is needed (TorchAO's entry fails on our tensors).
REGISTERED_OPS = (
    "split.Tensor", "slice.Tensor", "view.default", "as_strided.default", "new_zeros.default",
    "new_empty.default", "empty_like.default", "zeros_like.default", "_to_copy.default",
)

install_fsdp_support()  # registered once, when this module is first imported
