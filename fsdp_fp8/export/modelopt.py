"""Write a high-precision model as a ModelOpt static-FP8 checkpoint (see FORMAT.md).

The JSON files copy the layout of a real ModelOpt 0.47 export (key order, indentation,
trailing newlines) so that whatever reads ModelOpt's output reads ours the same way. Every
output is a pure function of the inputs: same model, same scales -> same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from fsdp_fp8.errors import ExportError, raise_if_problems
from fsdp_fp8.format.checkpoint import SCALE_SUFFIXES as _SCALE_SUFFIXES
from fsdp_fp8.format.quant_config import matches_ignore as is_ignored
from fsdp_fp8.fp8.tensor import E4M3_MAX
from fsdp_fp8.format.step_policy import check_step_policy

DEFAULT_IGNORE = ("proj_in", "proj_out", "time_embedder*", "lm_head", "embed_tokens")
_STEM = "diffusion_pytorch_model"


def producer_version() -> str:
    try:
        return metadata.version("fsdp_fp8")
    except metadata.PackageNotFoundError:
        return "0.1.0"


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
    # Clone: safetensors refuses tensors that share storage (tied weights, views).
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}


def _fp8_targets(model, ignore, input_scales, problems: list[str]) -> list[str]:
    """Names of the linears to quantize."""
    if isinstance(model, nn.Module):
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        unknown = sorted(set(input_scales or ()) - set(linears))
        problems += [f"`{n}` in input_scales is not an nn.Linear of the model" for n in unknown]
    else:
        linears = sorted(input_scales or ())  # a bare state_dict has no module types: the scales name the linears
    return [n for n in linears if not is_ignored(n, ignore)]


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


def quantization_config(ignore: list[str], step_policy: dict | None) -> dict[str, Any]:
    fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
    qc: dict[str, Any] = {
        "config_groups": {
            "group_0": {"input_activations": dict(fp8), "weights": dict(fp8), "targets": ["Linear"]}
        },
        "ignore": ignore,
        "quant_algo": "FP8",
        "producer": {"name": "fsdp_fp8", "version": producer_version()},
        "quant_method": "modelopt",
    }
    if step_policy is not None:
        qc["runtime"] = {"diffusion_step_policy": step_policy}
    return qc


def plan_shards(
    tensors: dict[str, torch.Tensor], max_shard_size: int | None, separate_scales: bool
) -> list[list[str]]:
    def nbytes(key: str) -> int:
        return tensors[key].numel() * tensors[key].element_size()

    keys = sorted(tensors)
    packed = [k for k in keys if not (separate_scales and k.endswith(_SCALE_SUFFIXES))]
    shards: list[list[str]] = [[]]
    size = 0
    for key in packed:
        if max_shard_size is not None and shards[-1] and size + nbytes(key) > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes(key)
    if separate_scales:
        # Each scale goes to the shard after its weight's (wrapping), so scales are mixed in
        # with other weights rather than parked in one "scales" file a reader could special-case.
        if len(shards) == 1:
            shards.append([])
        home = {k: i for i, shard in enumerate(shards) for k in shard}
        for key in keys:
            if key.endswith(_SCALE_SUFFIXES):
                weight_key = key.rsplit(".", 1)[0] + ".weight"
                shards[(home[weight_key] + 1) % len(shards)].append(key)
        shards = [sorted(s) for s in shards]
    return shards


def _write(directory, tensors, config, hf_quant, max_shard_size, separate_scales) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if any(directory.iterdir()):
        raise FileExistsError(f"{directory} is not empty; export writes into an empty directory")
    shards = plan_shards(tensors, max_shard_size, separate_scales)
    if len(shards) == 1:
        single = {k: tensors[k] for k in shards[0]}
        save_file(single, directory / f"{_STEM}.safetensors", {"format": "pt"})
    else:
        weight_map = {}
        for i, keys in enumerate(shards, start=1):
            name = f"{_STEM}-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file({k: tensors[k] for k in keys}, directory / name, {"format": "pt"})
            weight_map.update(dict.fromkeys(keys, name))
        index = {
            "metadata": {
                "total_parameters": sum(
                    t.numel() for k, t in tensors.items() if not k.endswith(_SCALE_SUFFIXES)
                ),
                "total_size": sum(t.numel() * t.element_size() for t in tensors.values()),
            },
            "weight_map": {k: weight_map[k] for k in sorted(weight_map)},
        }
        index_path = directory / f"{_STEM}.safetensors.index.json"
        index_path.write_text(json.dumps(index, indent=2) + "\n")
    # ModelOpt writes both JSON files with indent=4 and no trailing newline.
    (directory / "config.json").write_text(json.dumps(config, indent=4))
    if hf_quant is not None:
        (directory / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4))
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
    """
    ignore = list(ignore)
    if (calibrate is None) == (input_scales is None):
        raise ValueError("pass exactly one of `calibrate` and `input_scales`")
    if calibrate is not None and not isinstance(model, nn.Module):
        raise ValueError("`calibrate` needs an nn.Module, not a state_dict")
    if "quantization_config" in config:
        raise ValueError("`config` has a `quantization_config` already; pass the model's own")
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
    full_config["quantization_config"] = quantization_config(ignore, step_policy)
    hf_quant = {
        "producer": {"name": "fsdp_fp8", "version": producer_version()},
        "quantization": {
            "quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ignore,
        },
    }
    return _write(
        directory, tensors, full_config, hf_quant, max_shard_size, scales_in_separate_shard
    )


def export_bf16(
    model: nn.Module | Mapping[str, torch.Tensor],
    directory: str | Path,
    *,
    config: dict,
    max_shard_size: int | None = None,
) -> Path:
    """The same model unquantized, in its own dtype: same file layout, no quantization config."""
    if "quantization_config" in config:
        raise ValueError("`config` has a `quantization_config`; an unquantized export must not")
    full_config = {k: config[k] for k in sorted(config)}
    return _write(directory, _state_dict(model), full_config, None, max_shard_size, False)
