"""Static per-tensor FP8 weights: ``StaticFloat8Tensor``, a thin subclass of TorchAO's
``PrototypeFloat8Tensor`` that owns its FSDP2 all-gather hooks. The W8A8 / W8A16 math on
these weights is in ``fsdp_fp8.fp8.kernels``.

The weight is E4M3 codes with one F32 ``weight_scale``; activations use the calibrated
``input_scale``. Scales are held as (1, 1) tensors, as TorchAO's ``from_hp`` wants for 2-D inputs.
A subclass, not TorchAO's class itself, so the FSDP2 ops (``fsdp_fp8.fp8.ops``) and hooks apply to
our tensors only: a per-row or block-wise ``PrototypeFloat8Tensor`` is never gathered as ours.

Format: docs/checkpoint-format.md; design: docs/design.md, "An FP8 weight, sharded, padded and
gathered".
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torchao.float8.inference import Float8MMConfig
from torchao.prototype.quantization.float8_static_quant.prototype_float8_tensor import (
    PrototypeFloat8Tensor,
)
from torchao.quantization.granularity import PerTensor
from torchao.quantization.quantize_.common import KernelPreference
from torchao.quantization.quantize_.workflows import QuantizeTensorToFloat8Kwargs

from fsdp_fp8.errors import ArgumentError, ArgumentTypeError
from fsdp_fp8.format.checkpoint import E4M3, E4M3_MAX  # noqa: F401 - the one home of both names
from fsdp_fp8.shard_rows import padded_rows

# What TorchAO's own linear on this weight (``as_prototype``) uses; Float8StaticLinear passes
# its own ``fast_accum`` option (default False, F32 accumulation) to _scaled_mm instead.
MM_CONFIG = Float8MMConfig(use_fast_accum=False)
ACT_QUANT_KWARGS = QuantizeTensorToFloat8Kwargs(
    float8_dtype=E4M3,
    granularity=PerTensor(),
    mm_config=MM_CONFIG,
    kernel_preference=KernelPreference.TORCH,
)

# PrototypeFloat8Tensor's constructor fields, in its order. ``rebuild`` carries every one;
# if TorchAO adds, drops or renames a field, importing this module fails rather than
# letting FSDP2's reshaping silently lose it.
FIELDS = (
    "qdata",
    "scale",
    "act_quant_scale",
    "output_act_quant_scale",
    "block_size",
    "mm_config",
    "act_quant_kwargs",
    "kernel_preference",
    "dtype",
    "output_act_quant_kwargs",
)
_TORCHAO_FIELDS = tuple(inspect.signature(PrototypeFloat8Tensor.__init__).parameters)[1:]
if _TORCHAO_FIELDS != FIELDS:
    raise ImportError(
        f"TorchAO's PrototypeFloat8Tensor takes {_TORCHAO_FIELDS}; fsdp_fp8 was written for "
        f"{FIELDS} (torchao 0.18) and would drop a field when FSDP2 reshapes a weight"
    )


class StaticFloat8Tensor(PrototypeFloat8Tensor):
    """E4M3 codes with one weight scale and one activation scale (ModelOpt static FP8).

    The constructor is TorchAO's, with its fields checked: anything but per-tensor scales, or
    an output quantization (``output_act_quant_*``, which ``Float8StaticLinear`` never
    applies), is refused here, so every instance is what the FSDP2 ops and hooks assume.

    It has no ``__torch_function__`` layer: FSDP2 queries sizes, strides and devices ~40 times
    per parameter while it shards, and TorchAO's Python-level handler (which exists for its
    ``F.linear`` / ``matmul`` overrides) cost more than the ops themselves. ``Float8StaticLinear``
    never calls ``F.linear`` on the weight; for TorchAO's own linear use ``as_prototype(w)``.
    ``F.linear(x, w)`` without a bias still reaches TorchAO's ``mm``; with a bias it stops at
    TorchAO's missing ``addmm`` (a ``NotImplementedError``, never a wrong result).
    """

    __torch_function__ = torch._C._disabled_torch_function_impl
    # The fields live in slots rather than the instance dict: FSDP2 builds ~15 of these per
    # weight while it shards (``rebuild``), a slot is set faster than a dict entry, and no dict
    # is allocated per instance (bench/setup_cost.py). ``dtype`` is the wrapper's own.
    __slots__ = FIELDS[:8] + FIELDS[9:]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """TorchAO's dispatch (its op table, TorchAO's entries inherited), one lookup deep:
        FSDP2 runs ~9 ops per parameter while it shards, each through here."""
        impl = _OP_TABLE.get(func)
        if impl is None:
            raise NotImplementedError(
                f"{cls.__name__} dispatch: attempting to run unimplemented operator {func} (static FP8 "
                "weights support the ops FSDP2, to_empty and Float8StaticLinear run; see fsdp_fp8.fp8.ops)"
            )
        return impl(func, types, args, kwargs)

    def __init__(
        self,
        qdata: torch.Tensor,
        scale: torch.Tensor,
        act_quant_scale: torch.Tensor | None = None,
        output_act_quant_scale: torch.Tensor | None = None,
        block_size: list[int] | None = None,
        mm_config: Float8MMConfig | None = None,
        act_quant_kwargs: QuantizeTensorToFloat8Kwargs | None = None,
        kernel_preference: KernelPreference = KernelPreference.AUTO,
        dtype: torch.dtype | None = None,
        output_act_quant_kwargs: QuantizeTensorToFloat8Kwargs | None = None,
    ):
        problems = []
        if qdata.dtype != E4M3:
            problems.append(f"codes are {qdata.dtype}, not {E4M3}")
        if scale.numel() != 1:
            problems.append(f"the weight scale has {scale.numel()} elements, not 1")
        if act_quant_scale is None or act_quant_scale.numel() != 1:
            problems.append("the activation scale is not one element")
        if output_act_quant_scale is not None or output_act_quant_kwargs is not None:
            problems.append("output_act_quant_scale/output_act_quant_kwargs are set (no output quantization)")
        if problems:
            raise ArgumentError(problems, "not a static per-tensor FP8 weight")
        # The fields TorchAO's __init__ sets, set here directly: its __init__ also logs API
        # usage per instance (internal copies skip this constructor: ``rebuild``).
        _set_fields(
            self, qdata, scale, act_quant_scale, None, block_size, mm_config, act_quant_kwargs, kernel_preference, None
        )

    # --- FSDP2 all-gather extension (docs/design.md draws the flow) ----------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """Send this rank's rows of ``qdata`` as bytes, padded to ``ceil(rows / shards)`` rows.

        ``mesh`` is the one FSDP2 all-gathers over: the whole 1-D mesh, or under HSDP the 1-D
        shard sub-mesh of the 2-D mesh (FSDP2 passes ``mesh[mesh_dim_names[-1]]``), so
        ``shards = mesh.size()`` is the shard-dim size, never the world size. gloo refuses float8 ("Invalid scalar type") and NCCL takes the
        same bytes; the scales are per tensor and the same on every rank, so they never travel.
        """
        _require_static(self, "fsdp_pre_all_gather")
        padded_shape = (padded_rows(outer_size[0], mesh.size()), *outer_size[1:])
        codes = self.qdata
        if tuple(codes.shape) == padded_shape:
            payload = codes.view(torch.uint8)
        else:
            # FSDP2 keeps a rank's rows as a narrow() of a padded buffer after lazy init;
            # reuse that buffer when it is there instead of copying the shard every forward.
            storage = codes.untyped_storage()
            need = math.prod(padded_shape)
            if codes.is_contiguous() and storage.nbytes() - codes.storage_offset() >= need and codes.numel() > 0:
                payload = torch.empty(0, dtype=torch.uint8, device=codes.device).set_(
                    storage, codes.storage_offset(), padded_shape
                )
            else:
                payload = torch.zeros(padded_shape, dtype=torch.uint8, device=codes.device)
                if codes.numel() > 0:
                    payload.narrow(0, 0, codes.shape[0]).copy_(codes.view(torch.uint8))
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
        _require_static(self, "fsdp_post_all_gather")
        (gathered,) = all_gather_outputs
        (outer_size,) = metadata
        codes = gathered.view(E4M3).narrow(0, 0, outer_size[0])  # narrow: fakeable, unlike [:n]
        if out is not None:
            _require_static(out, "fsdp_post_all_gather(out=)")
            if out.qdata.untyped_storage().data_ptr() != codes.untyped_storage().data_ptr():
                out.qdata.copy_(codes)
            return None
        # The compute dtype is the module's, not FSDP's param_dtype: a mixed-precision policy
        # must not turn the dequantized arithmetic into something the checkpoint did not ask for.
        return rebuild(self, codes), (gathered,)


# The subclass's own op table (TorchAO's __init_subclass__ copied TorchAO's entries into it;
# fsdp_fp8.fp8.ops adds ours through ``implements``), read by ``__torch_dispatch__``.
_OP_TABLE = StaticFloat8Tensor._ATEN_OP_TABLE[StaticFloat8Tensor]

# Like TorchAO's own class: a model holding these loads with torch.load(weights_only=True).
torch.serialization.add_safe_globals([StaticFloat8Tensor])


def _require_static(t: Any, hook: str) -> None:
    if not is_static_fp8(t):
        raise ArgumentTypeError(
            f"StaticFloat8Tensor.{hook} was given a {type(t).__name__} that is not per-tensor static "
            "FP8 (its scales or output quantization were changed after construction)"
        )


def make_static_fp8_weight(
    qdata: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    compute_dtype: torch.dtype,
) -> StaticFloat8Tensor:
    """Wrap E4M3 codes and their two per-tensor scales; ``compute_dtype`` is the activation dtype.

    The scales are moved to the codes' device as F32 (a ``torch.tensor(0.01)`` next to CUDA codes
    would otherwise meet them in ``_scaled_mm``, which refuses operands on two devices), and the
    codes are made row-major when they are not (``_scaled_mm`` takes the weight as the
    column-major transpose of row-major codes). Both are no-ops for what the loader builds.
    """
    if qdata.dim() == 2 and not (qdata.stride(-1) == 1 and qdata.stride(0) >= max(2, qdata.shape[-1])):
        qdata = qdata.clone(memory_format=torch.contiguous_format)
    weight_scale, input_scale = (
        s if s.device == qdata.device and s.dtype == torch.float32 else s.to(qdata.device, torch.float32)
        for s in (weight_scale, input_scale)
    )
    return StaticFloat8Tensor(
        qdata,
        _as_1x1(weight_scale),
        act_quant_scale=_as_1x1(input_scale),
        block_size=list(qdata.shape),
        mm_config=MM_CONFIG,
        act_quant_kwargs=ACT_QUANT_KWARGS,
        kernel_preference=KernelPreference.TORCH,
        dtype=compute_dtype,
    )


def _as_1x1(scale: torch.Tensor) -> torch.Tensor:
    # A (1, 1) scale as it is: reshape would make a view, a second tensor per scale that the
    # weight keeps alive (two per linear at every swap, bench/setup_cost.py).
    return scale if scale.shape == (1, 1) else scale.reshape(1, 1)


def empty_static_fp8_weight(
    out_features: int, in_features: int, compute_dtype: torch.dtype, device: torch.device | str
) -> StaticFloat8Tensor:
    """An unfilled FP8 weight: 1 byte per element plus two F32 scales (meta by default)."""
    return make_static_fp8_weight(
        torch.empty(out_features, in_features, dtype=E4M3, device=device),
        torch.empty(1, 1, dtype=torch.float32, device=device),
        torch.empty(1, 1, dtype=torch.float32, device=device),
        compute_dtype,
    )


def is_static_fp8(t: Any) -> bool:
    """A ``StaticFloat8Tensor`` whose fields still say per-tensor static FP8 (what this package shards)."""
    return (
        isinstance(t, StaticFloat8Tensor)
        and t.scale.numel() == 1
        and t.act_quant_scale is not None
        and t.act_quant_scale.numel() == 1
        and t.output_act_quant_scale is None
        and t.output_act_quant_kwargs is None
    )


def _set_fields(
    out,
    qdata,
    scale,
    act_quant_scale,
    output_act_quant_scale,
    block_size,
    mm_config,
    act_quant_kwargs,
    kernel_preference,
    output_act_quant_kwargs,
) -> None:
    """Every field of ``FIELDS`` but ``dtype`` (the wrapper's own), as TorchAO's __init__ sets them."""
    out.qdata = qdata
    out.scale = scale
    out.act_quant_scale = act_quant_scale
    out.output_act_quant_scale = output_act_quant_scale
    out.block_size = block_size
    out.mm_config = mm_config
    out.act_quant_kwargs = act_quant_kwargs
    out.kernel_preference = kernel_preference
    out.output_act_quant_kwargs = output_act_quant_kwargs


_wrapper = torch.Tensor._make_wrapper_subclass


def rebuild(
    t: StaticFloat8Tensor,
    qdata: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    act_quant_scale: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> StaticFloat8Tensor:
    """``t`` with new codes, every other constructor field carried (``block_size`` follows the shape).

    Built without the constructor's checks, which ``t`` passed: FSDP2's ``chunk`` alone makes
    one of these per rank for every parameter, so the fields go straight into their slots.
    """
    out = _wrapper(StaticFloat8Tensor, qdata.shape, dtype=t.dtype if dtype is None else dtype, device=qdata.device)
    out.qdata = qdata
    out.scale = t.scale if scale is None else scale
    out.act_quant_scale = t.act_quant_scale if act_quant_scale is None else act_quant_scale
    out.output_act_quant_scale = t.output_act_quant_scale
    out.block_size = list(qdata.shape)
    out.mm_config = t.mm_config
    out.act_quant_kwargs = t.act_quant_kwargs
    out.kernel_preference = t.kernel_preference
    out.output_act_quant_kwargs = t.output_act_quant_kwargs
    return out


def as_prototype(t: StaticFloat8Tensor) -> PrototypeFloat8Tensor:
    """The same codes and scales as TorchAO's own class, for TorchAO's own linear (a reference)."""
    return PrototypeFloat8Tensor(*(getattr(t, name) for name in FIELDS))
