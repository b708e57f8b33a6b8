"""Runtime quantization (TorchAO PTQ) of a high-precision model's linears, for replicated inference.

The other road to FP8: no calibrated checkpoint; a BF16 checkpoint's weights are quantized after
loading, and activations dynamically per call (:func:`quantize_model`). Guarded: a plain
(unsharded) model only, never a ModelOpt static-FP8 checkpoint (``check_ptq_checkpoint``), only
on hardware that runs the method.

On CPU, TorchAO 0.18's ``quantize_`` refuses FP8 although ``torch._scaled_mm`` runs there, so we
build the very ``Float8Tensor`` it would (tests/distributed/test_ptq.py compares the bytes). On
CUDA we call ``quantize_``.

Usage and limits: docs/usage.md, "Runtime quantization (--quantize)".
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fsdp_fp8.errors import ArgumentError, QuantizeError, raise_if_problems

log = logging.getLogger(__name__)

METHODS = ("fp8", "mxfp8", "nvfp4")
GRANULARITIES = ("per_row", "per_tensor")
_COMPILED_PREFIX = "_orig_mod."
# What each method asks of a weight [out, in]: (out multiple, in multiple).
# fp8: torch._scaled_mm / cuBLASLt need both dims multiples of 16 (TorchAO silently leaves
# other linears in high precision; we refuse instead). mxfp8: 32-element blocks along `in`.
# nvfp4: TorchAO raises unless both dims are multiples of 16.
_SHAPE_RULES = {"fp8": (16, 16), "mxfp8": (1, 32), "nvfp4": (16, 16)}
_MX_CAPABILITY = (10, 0)  # mxfp8 / nvfp4 GEMMs: Blackwell (sm_100) and newer
_FP8_CAPABILITY = (8, 9)  # fp8 GEMMs: Ada / Hopper and newer


def check_ptq_checkpoint(checkpoint) -> None:
    """Refuse runtime quantization of a checkpoint that is already ModelOpt static FP8."""
    if checkpoint.quant.is_modelopt_fp8:
        raise ArgumentError(
            f"{checkpoint.directory} is a ModelOpt static-FP8 checkpoint; runtime quantization "
            "(--quantize) would throw away its calibrated scales and quantize its weights twice. "
            "Load it as it is (without --quantize), or quantize a BF16 checkpoint"
        )


def check_ptq_world_size(world_size: int) -> None:
    """Runtime quantization runs on one process: there is no sharded PTQ to run on N ranks."""
    if world_size > 1:
        raise ArgumentError(
            f"--quantize runs on a single process, not on {world_size} ranks: the quantized model "
            "is replicated, not FSDP-sharded. Run `python launch/infer.py --quantize ...` "
            "(or torchrun --nproc-per-node 1)"
        )


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes held by the weights of every linear (biases excluded): data plus any scales."""
    return sum(_tensor_bytes(m.weight) for m in model.modules() if _is_linear(m))


def quantize_model(
    model: nn.Module,
    method: str,
    *,
    include: Sequence[str] | str = (),
    exclude: Sequence[str] | str = (),
    granularity: str = "per_row",
) -> list[str]:
    """Quantize the selected ``nn.Linear`` weights of ``model`` in place; return their names.

    ``include`` / ``exclude``: regular expressions, matched with ``re.search`` against each
    module name with ``_orig_mod.`` (torch.compile) removed; no ``include`` selects every
    linear. ``granularity`` (``fp8`` only): ``per_row`` or ``per_tensor`` scales, for both
    the weight and the dynamically quantized activation. Everything is validated before any
    module is touched; every problem is raised at once as a ``QuantizeError`` (a ``ValueError``).
    """
    include, exclude = _patterns(include), _patterns(exclude)
    problems: list[str] = []
    if method not in METHODS:
        problems.append(f"unknown method {method!r}; expected one of {list(METHODS)}")
    if granularity not in GRANULARITIES:
        problems.append(f"unknown granularity {granularity!r}; expected one of {list(GRANULARITIES)}")
    elif granularity != "per_row" and method != "fp8":
        problems.append(f"granularity applies to fp8 only; {method} has its own block scales")
    problems += _sharded_problems(model)
    includes = [_compile(p, "include", problems) for p in include]
    excludes = [_compile(p, "exclude", problems) for p in exclude]
    if None in includes or None in excludes:
        raise_if_problems(problems, error=QuantizeError)  # a selection made with broken patterns means nothing
    selected: dict[str, nn.Module] = {}
    hits = [0] * len(includes)
    for raw_name, module in model.named_modules():
        if not _is_linear(module):
            continue
        name = raw_name.replace(_COMPILED_PREFIX, "")
        matched = [i for i, rx in enumerate(includes) if rx.search(name)]
        for i in matched:
            hits[i] += 1
        if (includes and not matched) or any(rx.search(name) for rx in excludes):
            continue
        selected[name] = module
    problems += [f"include pattern {p!r} matches no linear" for p, n in zip(include, hits) if n == 0]
    if not selected:
        problems.append(f"include {list(include)} / exclude {list(exclude)} select no linear")
    for name, module in selected.items():
        problems += _module_problems(name, module, method, granularity)
    problems += _hardware_problems(method, selected, granularity)
    raise_if_problems(problems, error=QuantizeError)

    if method == "fp8":
        _quantize_fp8(model, selected, granularity)
    else:
        _quantize_mx(model, selected, method)
    for name, module in selected.items():
        # TorchAO skips a linear it cannot handle without saying so; our checks above should
        # have refused such a module first.
        assert is_traceable_wrapper_subclass(module.weight), f"`{name}` was left unquantized"
    log.info("quantized %d linears to %s", len(selected), method)
    return sorted(selected)


def _patterns(value: Sequence[str] | str) -> tuple[str, ...]:
    # A bare string is one pattern, not a sequence of one-character patterns.
    return (value,) if isinstance(value, str) else tuple(value)


def _compile(pattern: str, kind: str, problems: list[str]) -> re.Pattern | None:
    try:
        return re.compile(pattern)
    except (re.error, TypeError) as exc:
        problems.append(f"{kind} pattern {pattern!r} is not a valid regular expression: {exc}")
        return None


def _is_fp8_static_linear(module: nn.Module) -> bool:
    from fsdp_fp8.fp8.linear import Float8StaticLinear  # fp8_linear pulls in the FSDP op table

    return isinstance(module, Float8StaticLinear)


def _is_linear(module: nn.Module) -> bool:
    # Float8StaticLinear is no nn.Linear, but selecting one must be refused, not skipped.
    return isinstance(module, nn.Linear) or _is_fp8_static_linear(module)


def _tensor_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    if is_traceable_wrapper_subclass(t):
        inner, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in inner)
    return t.numel() * t.element_size()


def _sharded_problems(model: nn.Module) -> list[str]:
    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    if not sharded:
        return []
    return [
        f"the model's parameters are FSDP shards (DTensor), e.g. `{sharded[0]}` "
        f"({len(sharded)} in all); runtime quantization is for a plain, replicated model: "
        "load it without a process group"
    ]


def _module_problems(name: str, module: nn.Module, method: str, granularity: str) -> list[str]:
    weight = module.weight
    # A Float8StaticLinear's weight is a TorchAO PrototypeFloat8Tensor: a subclass too.
    if is_traceable_wrapper_subclass(weight) or weight.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return [
            f"`{name}` is already quantized ({type(module).__name__}, weight "
            f"{type(weight).__name__} {weight.dtype}); exclude it"
        ]
    if weight.device.type == "meta":
        return [f"`{name}` is on the meta device; load the weights before quantizing"]
    problems = []
    out_mult, in_mult = _SHAPE_RULES.get(method, (1, 1))
    out_f, in_f = weight.shape
    if out_f % out_mult or in_f % in_mult:
        problems.append(
            f"`{name}` has weight shape ({out_f}, {in_f}); {method} needs out_features a "
            f"multiple of {out_mult} and in_features a multiple of {in_mult}; exclude it"
        )
    needs_bf16 = method != "fp8" or granularity == "per_row"
    allowed = (torch.bfloat16,) if needs_bf16 else (torch.bfloat16, torch.float16, torch.float32)
    if weight.dtype not in allowed:
        what = f"{method} {granularity}" if method == "fp8" else method
        problems.append(
            f"`{name}` has weight dtype {weight.dtype}; TorchAO's {what} takes {' / '.join(str(d) for d in allowed)}"
        )
    return problems


@functools.cache
def cpu_scaled_mm_takes_row_scales() -> bool:
    """Whether this torch's CPU ``torch._scaled_mm`` takes per-row scales.

    torch 2.10 and 2.11 take only per-tensor scales on CPU (an internal assert otherwise);
    2.13 takes both. Asked of the kernel itself, once, not read from a version number.
    """
    codes = torch.zeros(2, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(
            codes,
            torch.zeros(16, 16, dtype=torch.float8_e4m3fn).t(),
            scale_a=torch.ones(2, 1),
            scale_b=torch.ones(1, 16),
            out_dtype=torch.bfloat16,
        )
    except RuntimeError:
        return False
    return True


def _hardware_problems(method: str, selected: dict[str, nn.Module], granularity: str = "per_row") -> list[str]:
    if method not in METHODS:
        return []
    devices = sorted({str(m.weight.device) for m in selected.values() if m.weight.device.type != "meta"})
    problems = []
    for device in map(torch.device, devices):
        if device.type == "cuda":
            cap = torch.cuda.get_device_capability(device)
            need = _FP8_CAPABILITY if method == "fp8" else _MX_CAPABILITY
            if cap < need:
                problems.append(
                    f"{method} needs a CUDA GPU with compute capability >= {need[0]}.{need[1]}; "
                    f"{device} ({torch.cuda.get_device_name(device)}) has {cap[0]}.{cap[1]}"
                )
        elif method != "fp8":
            problems.append(
                f"{method} needs a CUDA GPU with compute capability >= "
                f"{_MX_CAPABILITY[0]}.{_MX_CAPABILITY[1]} (Blackwell); the model is on {device}"
            )
        elif device.type != "cpu":
            problems.append(f"fp8 runs on CPU or on CUDA with compute capability >= 8.9; the model is on {device}")
        elif granularity == "per_row" and not cpu_scaled_mm_takes_row_scales():
            problems.append(
                f"fp8 per_row on CPU needs a torch whose CPU _scaled_mm takes per-row scales "
                f"(2.13 does; this is {torch.__version__}): use granularity per_tensor, or CUDA"
            )
    return problems


def _fp8_config(granularity: str):
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor

    # set_inductor_config=False: quantize_ would otherwise change torch._inductor's global
    # config for the whole process, which a loader has no business doing.
    return Float8DynamicActivationFloat8WeightConfig(
        granularity=PerRow() if granularity == "per_row" else PerTensor(), set_inductor_config=False
    )


def _float8_weight(weight: torch.Tensor, config) -> torch.Tensor:
    """What TorchAO's fp8 ``quantize_`` handler builds, minus its CUDA-only hardware assert."""
    from torchao.quantization import Float8Tensor
    from torchao.quantization.quantize_.workflows import QuantizeTensorToFloat8Kwargs

    act_granularity, weight_granularity = config.granularity  # normalized by the config
    act_kwargs = QuantizeTensorToFloat8Kwargs(
        config.activation_dtype, act_granularity, kernel_preference=config.kernel_preference
    )
    return Float8Tensor.from_hp(
        weight.detach(),
        float8_dtype=config.weight_dtype,
        granularity=weight_granularity,
        mm_config=config.mm_config,
        kernel_preference=config.kernel_preference,
        act_quant_kwargs=act_kwargs,
    )


@torch.no_grad()
def _quantize_fp8(model: nn.Module, selected: dict[str, nn.Module], granularity: str) -> None:
    config = _fp8_config(granularity)
    on_cuda = {id(m) for m in selected.values() if m.weight.device.type == "cuda"}
    if on_cuda:
        from torchao.quantization import quantize_

        quantize_(model, config, filter_fn=lambda m, _fqn: id(m) in on_cuda)
    for module in selected.values():
        if id(module) not in on_cuda:
            module.weight = nn.Parameter(_float8_weight(module.weight, config), requires_grad=False)


@torch.no_grad()
def _quantize_mx(model: nn.Module, selected: dict[str, nn.Module], method: str) -> None:
    from torchao.prototype.mx_formats.inference_workflow import (
        MXDynamicActivationMXWeightConfig,
        NVFP4DynamicActivationNVFP4WeightConfig,
    )
    from torchao.quantization import quantize_

    config = MXDynamicActivationMXWeightConfig() if method == "mxfp8" else NVFP4DynamicActivationNVFP4WeightConfig()
    chosen = {id(m) for m in selected.values()}
    quantize_(model, config, filter_fn=lambda m, _fqn: id(m) in chosen)
