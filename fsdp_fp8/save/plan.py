"""``plan_save``: what one rank of a save will write, decided alone, before anything is written.

Pure: it reads the model (global shapes, this rank's local rows) and the source's parsed
configs, and returns a ``SavePlan``: the tensors to write (this rank's rows of each sharded one,
the replicated ones for rank 0), the file layout every rank must plan identically (``digest``),
the JSON configs, and every problem found. No file is touched and no rank is waited for, so it
runs, and is tested, without a process group.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchao.quantization import Float8Tensor  # what quantize_model (runtime PTQ) makes of an fp8 weight

from fsdp_fp8.collective import rank_and_world
from fsdp_fp8.collective.unusable import unusable_message
from fsdp_fp8.format.checkpoint import Checkpoint
from fsdp_fp8.format.step_policy import check_step_policy
from fsdp_fp8.format.writer import (
    STEM,
    CheckpointLayout,
    TensorSpec,
    dtype_problems,
    plan_checkpoint,
    quantization_configs,
)
from fsdp_fp8.fp8.tensor import E4M3, is_static_fp8
from fsdp_fp8.load.fsdp_wrap import local_rows, primary_replica
from fsdp_fp8.load.loaded import LoadedModel
from fsdp_fp8.load.plan import LoadPlan


@dataclass(frozen=True)
class SaveItem:
    """One tensor to write: ``rows`` is this rank's part (None: replicated, rank 0 writes ``value``)."""

    spec: TensorSpec
    rows: torch.Tensor | None = None  # this rank's rows of a Shard(0) tensor
    start: int = 0  # the global index of its first row
    value: torch.Tensor | None = None  # a replicated tensor, or a scale
    source: object | None = None  # a TensorEntry to copy (KV scales the model has no place for)

    def bytes_for(self, rank: int) -> int:
        """The bytes ``rank`` writes of this tensor."""
        if self.rows is not None:
            return self.rows.numel() * self.rows.element_size()
        return self.spec.nbytes if rank == 0 else 0


@dataclass(frozen=True)
class SavePlan:
    """What one rank writes; ``layout`` is None (and ``problems`` says why) when it cannot be saved."""

    rank: int
    items: tuple[SaveItem, ...]
    layout: CheckpointLayout | None
    config: dict  # config.json, with its quantization_config
    hf_quant: dict | None  # hf_quant_config.json, None when the source had none
    digest: str | None  # of everything that decides the bytes on disk; the same on every rank
    problems: tuple[str, ...]

    @property
    def bytes_to_write(self) -> int:
        """Tensor data this rank writes: its rows, and on rank 0 the replicated tensors too."""
        return sum(item.bytes_for(self.rank) for item in self.items)


def persistent_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and persistent buffer, once each (tied ones under the first name): what
    a checkpoint holds."""
    persistent = {
        f"{m}.{b}" if m else b
        for m, module in model.named_modules()
        for b in module._buffers
        if b not in module._non_persistent_buffers_set
    }
    yield from model.named_parameters()
    yield from ((n, b) for n, b in model.named_buffers() if n in persistent)


def static_fp8_parts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E4M3 codes, 0-d ``weight_scale``, 0-d ``input_scale``) of a static-FP8 weight's local tensor."""
    return weight.qdata, weight.scale.reshape(()), weight.act_quant_scale.reshape(())


def _ptq_parts(key: str, local: torch.Tensor, input_scales, problems: list[str]):
    """(codes, weight_scale, input_scale) of a TorchAO Float8Tensor weight (runtime PTQ)."""
    module = key.removesuffix(".weight")
    scale = local.scale
    if scale.numel() != 1:
        problems.append(
            f"`{key}` is a TorchAO {type(local).__name__} with {scale.numel()} scales "
            f"(shape {tuple(scale.shape)}); a ModelOpt static-FP8 weight has one: quantize "
            "with granularity='per_tensor'"
        )
        return None
    given = (input_scales or {}).get(module)
    if given is None:
        problems.append(
            f"`{module}` quantizes its input dynamically; pass its static input scale in "
            "`input_scales` (amax(|x|) / 448, e.g. from calibrate_input_scales)"
        )
        return None
    given = torch.as_tensor(given, dtype=torch.float32).detach().cpu().reshape(-1)
    if given.numel() != 1 or not (given.item() > 0 and given.isfinite().item()):
        problems.append(f"`{module}` in input_scales must be one positive finite number, got {given.tolist()}")
        return None
    return local.qdata, scale.detach().reshape(()), given.reshape(())


def _row_range(tensor: torch.Tensor, name: str, rank: int) -> tuple[int, int]:
    """The global rows ``[start, stop)`` this rank writes: its own under FSDP; none under HSDP
    unless it is in rank 0's replica (every replica holds the same rows: each row once)."""
    if not isinstance(tensor, DTensor):
        return 0, tensor.shape[0] if tensor.ndim else 1
    _, start, stop = local_rows(tensor, name)
    return (start, stop) if rank in primary_replica(tensor.device_mesh) else (start, start)


def _fp8_items(name, key, tensor, local, rank, input_scales, problems) -> list[SaveItem]:
    if is_static_fp8(local):
        codes, w_scale, i_scale = static_fp8_parts(local)
    else:
        found = _ptq_parts(key, local, input_scales, problems)
        if found is None:
            return []
        codes, w_scale, i_scale = found
    stem = key.removesuffix(".weight")
    spec = TensorSpec(key, E4M3, tuple(tensor.shape))
    if isinstance(tensor, DTensor):
        start, stop = _row_range(tensor, name, rank)
        weight = SaveItem(spec, rows=codes[: stop - start], start=start)
    else:
        weight = SaveItem(spec, value=codes)
    return [
        weight,
        SaveItem(TensorSpec(f"{stem}.weight_scale", torch.float32, ()), value=w_scale),
        SaveItem(TensorSpec(f"{stem}.input_scale", torch.float32, ()), value=i_scale),
    ]


def _items(model: nn.Module, names: Mapping[str, str], rank: int, input_scales, problems: list[str]) -> list[SaveItem]:
    items: list[SaveItem] = []
    for name, tensor in persistent_tensors(model):
        key = names.get(name, name)
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        if is_static_fp8(local) or isinstance(local, Float8Tensor):
            items += _fp8_items(name, key, tensor, local, rank, input_scales, problems)
        elif type(local) not in (torch.Tensor, nn.Parameter):
            problems.append(
                f"`{name}` is a {type(local).__name__}; only plain tensors and static-FP8 "
                "weights (Float8StaticLinear, TorchAO per-tensor Float8Tensor) can be saved"
            )
        elif local.is_meta:
            problems.append(f"`{name}` is on the meta device; load or materialize the model before saving")
        elif isinstance(tensor, DTensor):
            start, stop = _row_range(tensor, name, rank)
            rows = local[: stop - start] if tensor.ndim else local
            items.append(SaveItem(TensorSpec(key, tensor.dtype, tuple(tensor.shape)), rows=rows, start=start))
        else:
            items.append(SaveItem(TensorSpec(key, tensor.dtype, tuple(tensor.shape)), value=tensor))
    return items


def _ignore_list(items: list[SaveItem], quant) -> list[str]:
    if quant is not None and quant.is_modelopt_fp8:
        return list(quant.ignore)
    return sorted(
        {
            i.spec.key.removesuffix(".weight")
            for i in items
            if i.spec.key.endswith(".weight") and i.spec.dtype != E4M3 and len(i.spec.shape) == 2
        }
    )


def _configs(items, checkpoint, config, step_policy, problems) -> tuple[dict, dict | None]:
    base = dict(config if config is not None else checkpoint.config if checkpoint is not None else {})
    base.pop("quantization_config", None)
    full = {k: base[k] for k in sorted(base)}
    fp8 = any(i.spec.dtype == E4M3 for i in items)
    kv = any(i.spec.key.endswith((".k_scale", ".v_scale")) for i in items)
    quant = checkpoint.quant if checkpoint is not None else None
    if step_policy is None and quant is not None and quant.is_modelopt_fp8:
        step_policy = quant.step_policy
    if step_policy is not None:
        found: list[str] = []
        check_step_policy(step_policy, found)
        problems += [f"step policy: {p}" for p in found]
    if not fp8:
        if step_policy is not None or kv:
            problems.append(
                "the model has no static-FP8 linear, so the checkpoint would have no quantization "
                "config to carry the step policy / KV-cache scales"
            )
        return full, None
    qc, hf_quant = quantization_configs(_ignore_list(items, quant), step_policy=step_policy, kv_cache=kv)
    full["quantization_config"] = qc
    # A diffusers-style checkpoint has no hf_quant_config.json; keep the source's choice.
    if checkpoint is not None and "hf_quant_config.json" not in checkpoint.json_files:
        hf_quant = None
    return full, hf_quant


def _digest(layout: CheckpointLayout, config: dict, hf_quant: dict | None) -> str:
    h = hashlib.sha256(repr(layout.digest_fields()).encode())
    h.update(repr((sorted(config.items(), key=str), hf_quant)).encode())
    return h.hexdigest()


def _weight_stem(checkpoint: Checkpoint | None) -> str:
    if checkpoint is not None and any(name.startswith("model") for name in checkpoint.files):
        return "model"
    return STEM


def _copied_kv_scales(items, checkpoint: Checkpoint | None, load_plan: LoadPlan | None) -> list[SaveItem]:
    """KV-cache scales of the source the model has no tensor for (a transformers Llama keeps its
    KV cache in the model dtype): copied from the source files."""
    held = {i.spec.key for i in items}
    keys = load_plan.kv_scales if load_plan is not None else checkpoint.kv_scales if checkpoint is not None else ()
    copied = []
    for key in keys:
        entry = checkpoint.kv_scales[key]
        if key not in held:
            copied.append(SaveItem(TensorSpec(key, entry.torch_dtype, entry.shape), source=entry))
    return copied


def plan_save(
    model: nn.Module | LoadedModel,
    *,
    checkpoint: Checkpoint | None = None,
    load_plan: LoadPlan | None = None,
    config: dict | None = None,
    input_scales: Mapping[str, float | torch.Tensor] | None = None,
    step_policy: dict | None = None,
    max_shard_size: int | None = None,
    unusable: str | None = None,
    rank: int | None = None,
) -> SavePlan:
    """What ``rank`` (default: this process's rank, 0 without a process group) writes of ``model``.

    The arguments are ``save_checkpoint``'s: ``checkpoint`` and ``load_plan`` are what the
    model was loaded from (configs, step policy, KV-cache scales, key names; a ``LoadedModel``
    brings both), ``config`` replaces the source's ``config.json``. ``unusable``: why the model
    must not be saved (its load did not finish, or it was closed), if it must not. Problems are returned, not
    raised; nothing is written and no rank is waited for.
    """
    if isinstance(model, LoadedModel):
        checkpoint = model.checkpoint if checkpoint is None else checkpoint
        load_plan = model.plan if load_plan is None else load_plan
        model = model.model
    if rank is None:
        rank = rank_and_world()[0]
    problems: list[str] = []
    if checkpoint is None and config is None:
        problems.append("pass `config` (the model's config dict) or the `source` it was loaded from")
    if unusable:  # its storage was released: nothing more can be planned from its tensors
        problems.append(unusable_message(unusable, "saved"))
        return SavePlan(rank, (), None, config or {}, None, None, tuple(sorted(problems)))
    names: dict[str, str] = {}  # model name -> checkpoint key, as the load planned it
    if load_plan is not None:
        names.update({f"{t.module}.weight": t.entry.weight.key for t in load_plan.fp8})
        names.update({t.name: t.entry.key for t in load_plan.tensors})
    items = _items(model, names, rank, input_scales, problems)
    items += _copied_kv_scales(items, checkpoint, load_plan)
    counts = Counter(i.spec.key for i in items)
    problems += [
        f"`{k}` would be written {n} times (several model tensors map to it)" for k, n in counts.items() if n > 1
    ]
    dtype_problems((i.spec for i in items), problems)
    full_config, hf_quant = _configs(items, checkpoint, config, step_policy, problems)
    layout = digest = None
    if not problems:
        layout = plan_checkpoint((i.spec for i in items), stem=_weight_stem(checkpoint), max_shard_size=max_shard_size)
        digest = _digest(layout, full_config, hf_quant)
    return SavePlan(rank, tuple(items), layout, full_config, hf_quant, digest, tuple(sorted(problems)))
