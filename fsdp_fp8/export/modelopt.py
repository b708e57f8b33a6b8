"""Quantize a high-precision model to ModelOpt static FP8 and write the checkpoint (see docs/).

Quantization and calibration live here; the files are written by the package's one
checkpoint writer (``fsdp_fp8.format.writer``), which copies the layout of a real ModelOpt
0.47 export (key order, indentation, trailing newlines) so that whatever reads ModelOpt's
output reads ours the same way. Every output is a pure function of the inputs: same model,
same scales -> same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdp_fp8.errors import ArgumentError, ExportError, raise_if_problems
from fsdp_fp8.format.quant_config import matches_ignore
from fsdp_fp8.format.step_policy import check_step_policy
from fsdp_fp8.format.writer import TensorSpec, plan_checkpoint, quantization_configs, write_checkpoint
from fsdp_fp8.fp8.tensor import E4M3_MAX

DEFAULT_IGNORE = ("proj_in", "proj_out", "time_embedder*", "lm_head", "embed_tokens")


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor static FP8: (codes, 0-d float32 ``weight_scale = amax(|W|) / 448``)."""
    w = weight.detach().float()
    scale = w.abs().amax() / E4M3_MAX
    codes = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scale.reshape(())


@torch.no_grad()
def calibrate_input_scales(
    model: nn.Module, names: Iterable[str], calibrate: Callable[[nn.Module], Any]
) -> dict[str, torch.Tensor]:
    """Run ``calibrate(model)`` and return ``amax(|x|) / 448`` of each named module's input."""
    modules = dict(model.named_modules())
    amax: dict[str, torch.Tensor] = {}

    def hook_for(name: str):
        def hook(_module, args):
            seen = args[0].detach().abs().amax().float().cpu()
            amax[name] = torch.maximum(amax[name], seen) if name in amax else seen

        return hook

    handles = [modules[n].register_forward_pre_hook(hook_for(n)) for n in names]
    try:
        calibrate(model)
    finally:
        for handle in handles:
            handle.remove()
    return {n: (a / E4M3_MAX).reshape(()) for n, a in amax.items()}


def _state_dict(model: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sd = model.state_dict() if isinstance(model, nn.Module) else dict(model)
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


def _fp8_targets(model, ignore, input_scales, problems: list[str]) -> list[str]:
    """Names of the linears to quantize."""
    if isinstance(model, nn.Module):
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        unknown = sorted(set(input_scales or ()) - set(linears))
        problems += [f"`{n}` in input_scales is not an nn.Linear of the model" for n in unknown]
    else:
        linears = sorted(input_scales or ())  # a bare state_dict has no module types: the scales name the linears
    return [n for n in linears if not matches_ignore(n, ignore)]


def _fp8_tensors(sd, targets, input_scales, problems: list[str]) -> dict[str, torch.Tensor]:
    out = dict(sd)
    for name in targets:
        key = f"{name}.weight"
        weight = sd.get(key)
        if weight is None or weight.dim() != 2:
            problems.append(f"`{key}` is missing or not 2-D")
            continue
        scale = input_scales.get(name)
        if scale is None:
            problems.append(f"`{name}` has no input scale (never called during calibration?)")
            continue
        scale = torch.as_tensor(scale, dtype=torch.float32).detach().cpu()
        if scale.numel() != 1 or not (scale.item() > 0 and scale.isfinite().item()):
            problems.append(f"`{name}.input_scale` must be one positive finite number, got {scale}")
            continue
        codes, weight_scale = quantize_weight(weight)
        if not weight_scale.item() > 0:
            problems.append(f"`{key}` is all zeros: no per-tensor FP8 scale exists")
            continue
        out[key], out[f"{name}.weight_scale"] = codes, weight_scale
        out[f"{name}.input_scale"] = scale.reshape(()).clone()
    return out


def _write(directory, tensors, config, hf_quant, max_shard_size, separate_scales) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if any(directory.iterdir()):
        raise FileExistsError(f"{directory} is not empty; export writes into an empty directory")
    layout = plan_checkpoint(
        (TensorSpec.of(k, t) for k, t in tensors.items()),
        max_shard_size=max_shard_size,
        separate_scales=separate_scales,
    )
    write_checkpoint(directory, tensors, layout, config, hf_quant)
    return directory


def export_fp8(
    model: nn.Module | Mapping[str, torch.Tensor],
    directory: str | Path,
    *,
    config: dict,
    calibrate: Callable[[nn.Module], Any] | None = None,
    input_scales: Mapping[str, float | torch.Tensor] | None = None,
    ignore: Iterable[str] = DEFAULT_IGNORE,
    step_policy: dict | None = None,
    max_shard_size: int | None = None,
    scales_in_separate_shard: bool = False,
) -> Path:
    """Quantize every non-ignored linear to static FP8 and write the checkpoint.

    Input scales come from ``calibrate(model)`` (forward hooks record max |x| per linear)
    or, precomputed, from ``input_scales`` (module name -> scale, already divided by 448).
    ``model`` is a plain (unsharded) module, or a bare state_dict when ``input_scales``
    names its linears.
    ``max_shard_size`` bounds the weights of each shard in bytes; with
    ``scales_in_separate_shard`` every scale is written to a shard other than its weight's.
    Problems with the model, the scales or the policy are raised together as an ``ExportError``.
    """
    ignore = list(ignore)
    if (calibrate is None) == (input_scales is None):
        raise ArgumentError("pass exactly one of `calibrate` and `input_scales`")
    if calibrate is not None and not isinstance(model, nn.Module):
        raise ArgumentError("`calibrate` needs an nn.Module, not a state_dict")
    if "quantization_config" in config:
        raise ArgumentError("`config` has a `quantization_config` already; pass the model's own")
    problems: list[str] = []
    if step_policy is not None:
        found: list[str] = []
        check_step_policy(step_policy, found)
        problems += [f"export_fp8(step_policy=...): {p}" for p in found]
    targets = _fp8_targets(model, ignore, input_scales, problems)
    if calibrate is not None:
        input_scales = calibrate_input_scales(model, targets, calibrate)
    tensors = _fp8_tensors(_state_dict(model), targets, input_scales, problems)
    raise_if_problems(problems, "cannot export FP8", ExportError)
    full_config = {k: config[k] for k in sorted(config)}
    full_config["quantization_config"], hf_quant = quantization_configs(ignore, step_policy=step_policy)
    return _write(directory, tensors, full_config, hf_quant, max_shard_size, scales_in_separate_shard)


def export_bf16(
    model: nn.Module | Mapping[str, torch.Tensor],
    directory: str | Path,
    *,
    config: dict,
    max_shard_size: int | None = None,
) -> Path:
    """The same model unquantized, in its own dtype: same file layout, no quantization config."""
    if "quantization_config" in config:
        raise ArgumentError("`config` has a `quantization_config`; an unquantized export must not")
    full_config = {k: config[k] for k in sorted(config)}
    return _write(directory, _state_dict(model), full_config, None, max_shard_size, False)
