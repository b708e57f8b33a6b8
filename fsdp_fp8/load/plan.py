"""Match an opened checkpoint against a meta-device model, checking everything, changing nothing.

The plan is what the loader executes: which ``nn.Linear`` becomes FP8 (and from which
weight/scales), which parameter or persistent buffer gets which high-precision tensor.
Shape and dtype must match exactly; a dtype mismatch is refused rather than cast, because a
silent cast changes numerics the user did not ask to change.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from fsdp_fp8.collective import rank_and_world
from fsdp_fp8.errors import raise_if_problems
from fsdp_fp8.format.checkpoint import Checkpoint, Fp8ModuleEntry
from fsdp_fp8.format.safetensors_header import TensorEntry
from fsdp_fp8.reading import slice_reader
from fsdp_fp8.reading.rank_bytes import RankForecast, entry_rank_bytes, rank_forecast
from fsdp_fp8.reading.read_options import DEFAULT_READ_OPTIONS
from fsdp_fp8.shard_rows import rank_rows

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fp8Target:
    module: str  # model module name
    entry: Fp8ModuleEntry
    out_features: int
    in_features: int
    compute_dtype: torch.dtype  # the model Linear weight's dtype


@dataclass(frozen=True)
class TensorTarget:
    name: str  # model state_dict key (parameter or persistent buffer)
    entry: TensorEntry
    replicated: bool = False  # a persistent buffer: FSDP2 shards parameters only, every rank reads it whole


@dataclass(frozen=True, eq=False)
class LoadPlan:
    checkpoint: Checkpoint
    fp8: tuple[Fp8Target, ...]
    tensors: tuple[TensorTarget, ...]
    missing: tuple[str, ...]  # model keys nothing in the checkpoint fills
    unexpected: tuple[str, ...]  # checkpoint keys with no place in the model
    skipped: tuple[str, ...]  # checkpoint keys key_map mapped to None
    kv_scales: tuple[str, ...]  # checkpoint KV-cache scales the model has no place for: present, unused

    def _entries(self) -> list[TensorEntry]:
        out = [e for t in self.fp8 for e in (t.entry.weight, t.entry.weight_scale, t.entry.input_scale)]
        return out + [t.entry for t in self.tensors]

    @property
    def fp8_bytes(self) -> int:
        """FP8 weight codes plus their scales."""
        return sum(e.nbytes for t in self.fp8 for e in (t.entry.weight, t.entry.weight_scale, t.entry.input_scale))

    @property
    def high_precision_bytes(self) -> int:
        return sum(t.entry.nbytes for t in self.tensors)

    @functools.cached_property
    def replicated(self) -> frozenset[str]:
        """Checkpoint keys every rank reads whole: the persistent buffers (FSDP2 shards
        parameters only; 0-d tensors are whole on every rank anyway)."""
        return frozenset(t.entry.key for t in self.tensors if t.replicated)

    def _share(self, entry: TensorEntry, shards: int, shard: int) -> int:
        return entry_rank_bytes(entry, shards, shard, replicated=entry.key in self.replicated)

    def rank_bytes(self, shards: int, shard: int) -> int:
        """Bytes shard coordinate ``shard`` of ``shards`` reads: Shard(0) rows of every parameter;
        0-d scales and buffers whole."""
        return sum(self._share(e, shards, shard) for e in self._entries())

    def load_bytes(self, shards: int, shard: int) -> int:
        """Bytes the rank-slice load itself reads: ``rank_bytes`` less the FP8 and KV-cache
        scales, which were read (and checked) when the checkpoint was opened and load from memory."""
        return sum(self._share(e, shards, shard) for e in self.read_entries())

    def forecast(self, shards: int, shard: int, staging_bytes: int | None = None) -> RankForecast:
        """What shard coordinate ``shard`` reads (FP8 / high precision), holds, and stages through
        host memory into an accelerator (``staging_bytes`` defaults to ``ReadOptions().staging_bytes``)."""
        if staging_bytes is None:
            staging_bytes = DEFAULT_READ_OPTIONS.staging_bytes
        fp8 = [e for t in self.fp8 for e in (t.entry.weight, t.entry.weight_scale, t.entry.input_scale)]
        return rank_forecast(
            fp8,
            [t.entry for t in self.tensors],
            shards,
            shard,
            staging_bytes,
            staged_entries=self.read_entries(),
            replicated=self.replicated,
        )

    def rank_ranges(self, shards: int, shard: int) -> list[tuple[TensorEntry, int, int]]:
        """(entry, file offset, bytes) of the rows shard coordinate ``shard`` reads (``torch.chunk``
        rows of every parameter, buffers whole): what the load will read, known before the model
        is sharded."""
        out, whole = [], self.replicated
        for entry in self.read_entries():
            start, stop = rank_rows(entry.shape, shards, shard, replicated=entry.key in whole)
            offset, nbytes = slice_reader.row_range(entry, start, stop)
            out.append((entry, offset, nbytes))
        return out

    def slowest_rank_bytes(self, shards: int) -> int:
        """The most bytes any shard coordinate of ``shards`` reads (what the outcome's wait is sized by)."""
        return max(self.rank_bytes(shards, shard) for shard in range(shards))

    def facts(self) -> dict[str, str]:
        """What the ranks compare before loading: every target and what is left out, by key."""
        facts = {
            f"fp8 {t.module}": f"{t.entry.weight.key} ({t.out_features}, {t.in_features}) {t.compute_dtype}"
            for t in self.fp8
        }
        facts.update({f"tensor {t.name}": t.entry.key for t in self.tensors})
        for what in ("missing", "unexpected", "skipped", "kv_scales"):
            facts.update({f"{what} {key}": "yes" for key in getattr(self, what)})
        return facts

    def read_entries(self) -> list[TensorEntry]:
        """What the rank-slice load reads rows of: FP8 codes and high-precision tensors; the
        scales (FP8 and KV-cache) were checked when the checkpoint was opened and load from memory."""
        scales = self.checkpoint.scales
        return [t.entry.weight for t in self.fp8] + [t.entry for t in self.tensors if t.entry.key not in scales]


def _quantized(weight: torch.Tensor) -> bool:
    # A torchao/float8 weight is a tensor subclass; a plain Linear holds Parameter/Tensor.
    return type(weight) not in (nn.Parameter, torch.Tensor) or weight.dtype.itemsize == 1


# A per-expert linear as ModelOpt exports MoE layers: `<...>.experts.<e>.<proj>`.
_EXPERT = re.compile(r"^(?P<experts>.+)\.(?P<index>\d+)\.[^.]+$")


def _fused_experts(target: str, modules: dict[str, nn.Module]) -> str | None:
    """The model module holding fused expert weights where ``target`` is a per-expert linear."""
    match = _EXPERT.match(target)
    if match is None or match["experts"] not in modules or f"{match['experts']}.{match['index']}" in modules:
        return None
    holder = modules[match["experts"]]
    return match["experts"] if any(p.ndim == 3 for p in holder.parameters(recurse=False)) else None


def _dtype_fix(mismatches: list[tuple[torch.dtype, torch.dtype]]) -> str:
    """How to fix the dtype refusals at once, said once when there are several (a model built
    in another dtype: every high-precision tensor is refused, and one fix covers them all)."""
    if len(mismatches) < 2:
        return ""
    wanted = max({c for c, _ in mismatches}, key=[c for c, _ in mismatches].count)
    built = sorted({str(m) for _, m in mismatches})
    return (
        f"; to fix all {len(mismatches)} dtype refusals: build the model in the checkpoint's dtype "
        f"({wanted}, not {', '.join(built)}: e.g. `model.to({wanted})` in model_fn, or `torch_dtype={wanted}` "
        "for a transformers / diffusers class), or pass model_fn=None to build the class config.json names"
    )


@dataclass
class _Planning:
    """What ``plan_load`` collects while it walks the checkpoint (every list grows, nothing raises)."""

    checkpoint: Checkpoint
    key_map: Callable[[str], str | None]
    modules: dict[str, nn.Module]
    state: dict[str, torch.Tensor]  # parameters and persistent buffers
    owner: dict[int, str] = field(default_factory=dict)  # id(model tensor) -> checkpoint key; catches ties
    problems: list[str] = field(default_factory=list)
    dtype_mismatches: list[tuple[torch.dtype, torch.dtype]] = field(default_factory=list)  # (checkpoint, model)
    dtype_problem_at: list[int] = field(default_factory=list)  # where in ``problems`` each refusal is
    fp8: list[Fp8Target] = field(default_factory=list)
    tensors: list[TensorTarget] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    kv_unused: list[str] = field(default_factory=list)
    fused: dict[str, list[str]] = field(default_factory=dict)  # experts module -> per-expert FP8 weights

    def claim(self, model_key: str, ckpt_key: str) -> bool:
        tensor_id = id(self.state[model_key])
        if tensor_id in self.owner:
            self.problems.append(f"`{ckpt_key}` and `{self.owner[tensor_id]}` both map to model `{model_key}`")
            return False
        self.owner[tensor_id] = ckpt_key
        return True

    def fp8_linear(self, name: str, m) -> None:
        """One checkpoint FP8 linear: a target, or why not."""
        own_keys = [m.weight.key, m.weight_scale.key, m.input_scale.key]
        where = f"`{m.weight.key}` in {m.weight.file}"
        mapped = self.key_map(m.weight.key)
        if mapped is None:
            self.skipped.extend(own_keys)
            return
        if not mapped.endswith(".weight"):
            self.problems.append(f"{where} maps to `{mapped}`, which is not a `.weight`")
            return
        target = mapped[: -len(".weight")]
        module = self.modules.get(target)
        if module is None and (experts := _fused_experts(target, self.modules)) is not None:
            self.fused.setdefault(experts, []).append(m.weight.key)
            return
        if module is None:
            self.unexpected.extend(own_keys)
            return
        problem = _linear_problem(where, target, module)
        if problem:
            self.problems.append(problem)
            return
        expected = (module.out_features, module.in_features)
        if m.weight.shape != expected or tuple(module.weight.shape) != expected:
            self.problems.append(
                f"{where} has shape {m.weight.shape} but the model expects {expected} for `{target}.weight`"
            )
        if (m.bias is None) != (module.bias is None):
            has = "has" if m.bias is not None else "has no"
            self.problems.append(
                f"{where}: the checkpoint {has} `{name}.bias` but model `{target}` "
                f"{'has no' if module.bias is None else 'has a'} bias"
            )
        if self.claim(mapped, m.weight.key):
            self.fp8.append(Fp8Target(target, m, module.out_features, module.in_features, module.weight.dtype))

    def tensor(self, key: str, entry: TensorEntry) -> None:
        """One high-precision tensor or KV-cache scale: a target, or why not."""
        mapped = self.key_map(key)
        if mapped is None:
            self.skipped.append(key)
            return
        if mapped not in self.state:
            (self.kv_unused if key in self.checkpoint.kv_scales else self.unexpected).append(key)
            return
        have = self.state[mapped]
        where = f"`{key}` in {entry.file}"
        if entry.shape != tuple(have.shape):
            self.problems.append(
                f"{where} has shape {entry.shape} but the model expects {tuple(have.shape)} for `{mapped}`"
            )
        if entry.torch_dtype != have.dtype:
            self.problems.append(
                f"{where} is {entry.dtype} ({entry.torch_dtype}) but model `{mapped}` is "
                f"{have.dtype}; refusing to cast silently"
            )
            self.dtype_mismatches.append((entry.torch_dtype, have.dtype))
            self.dtype_problem_at.append(len(self.problems) - 1)
        if self.claim(mapped, key):
            self.tensors.append(TensorTarget(mapped, entry, replicated=not isinstance(have, nn.Parameter)))

    def fused_problems(self) -> list[str]:
        found = []
        for experts, keys in sorted(self.fused.items()):
            holder = self.modules[experts]
            params = ", ".join(f"`{n}` {tuple(p.shape)}" for n, p in holder.named_parameters(recurse=False))
            found.append(
                f"{len(keys)} per-expert FP8 linears (`{keys[0]}`, ...) in the checkpoint, but model module "
                f"`{experts}` is a {type(holder).__name__} with fused expert parameters {params}: per-expert "
                "static-FP8 weights each carry their own scale and cannot be loaded into fused tensors; "
                "refusing rather than loading the model without its experts"
            )
        return found

    def kv_scale_problems(self, strict_kv_scales: bool) -> list[str]:
        if not self.kv_unused:
            return []
        what = (
            f"{len(self.kv_unused)} FP8 KV-cache scales (`{self.kv_unused[0]}`, ...) are in the checkpoint but "
            "the model has no tensor for them (its attention does not quantize the KV cache)"
        )
        if strict_kv_scales:
            return [f"{what}; refusing under strict_kv_scales"]
        if rank_and_world()[0] == 0:  # every rank plans: one says it
            logger.warning("%s: present but unused; the KV cache stays in the model dtype", what)
        return []


def _linear_problem(where: str, target: str, module: nn.Module) -> str | None:
    """Why model module ``target`` cannot take an FP8 weight (already quantized, not a Linear)."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and _quantized(weight):
        return (
            f"{where}: model module `{target}` is already quantized (weight is {type(weight).__name__} {weight.dtype})"
        )
    if not isinstance(module, nn.Linear):
        return f"{where}: model module `{target}` is a {type(module).__name__}, not an nn.Linear"
    return None


def plan_load(
    checkpoint: Checkpoint,
    model: nn.Module,
    key_map: Callable[[str], str | None] | None = None,
    strict: bool = True,
    strict_kv_scales: bool = False,
) -> LoadPlan:
    """The load plan, or one ``CheckpointError`` listing every problem.

    ``strict``: refuse model tensors nothing fills and checkpoint tensors with no place.
    FP8 KV-cache scales (``*.k_scale`` / ``*.v_scale``) load into model tensors of the same
    name when the model has them; otherwise they are reported as present but unused (a
    warning, ``LoadPlan.kv_scales``), or refused with ``strict_kv_scales``. Per-expert FP8
    linears that meet fused 3-D expert parameters are always refused: loading the rest
    would leave the experts empty.
    """
    p = _Planning(
        checkpoint,
        key_map or (lambda key: key),
        dict(model.named_modules(remove_duplicate=False)),
        model.state_dict(keep_vars=True),
    )
    for name, m in sorted(checkpoint.fp8_modules.items()):
        p.fp8_linear(name, m)
    for key, entry in sorted({**checkpoint.high_precision, **checkpoint.kv_scales}.items()):
        p.tensor(key, entry)
    if p.dtype_problem_at:  # the fix, once, on the first refusal (one line per problem stays)
        p.problems[p.dtype_problem_at[0]] += _dtype_fix(p.dtype_mismatches)
    problems = p.problems + p.fused_problems() + p.kv_scale_problems(strict_kv_scales)
    covered = set(p.owner)
    missing = sorted(k for k, v in p.state.items() if id(v) not in covered)
    if strict:
        problems += [f"model `{k}` is not filled by any checkpoint tensor" for k in missing]
        problems += [
            f"checkpoint tensor `{k}` in {checkpoint.tensors[k].file} has no place in the model" for k in p.unexpected
        ]
    raise_if_problems(problems, f"load plan for {checkpoint.directory}")
    return LoadPlan(
        checkpoint,
        tuple(p.fp8),
        tuple(p.tensors),
        tuple(missing),
        tuple(sorted(p.unexpected)),
        tuple(sorted(p.skipped)),
        tuple(sorted(p.kv_unused)),
    )


def warn_not_strict(plan: LoadPlan) -> None:
    """With strict=False, what stays unfilled (uninitialized memory) or unused is said aloud, by rank 0."""
    rank0 = rank_and_world()[0] == 0
    if rank0 and plan.missing:
        logger.warning(
            "strict=False: %d model tensors are in no checkpoint file and stay uninitialized: %s",
            len(plan.missing),
            ", ".join(plan.missing[:20]),
        )
    if rank0 and plan.unexpected:
        logger.warning(
            "strict=False: %d checkpoint tensors have no place in the model and are not loaded: %s",
            len(plan.unexpected),
            ", ".join(plan.unexpected[:20]),
        )
