"""``save_checkpoint``: write a (sharded) model back as a ModelOpt static-FP8 checkpoint.

Nothing is gathered. Every rank plans the same file layout from the global shapes
(``fsdp_fp8.format.writer``), rank 0 creates the files (headers, full size) in a hidden
temporary directory beside the target, every rank writes its own rows of each tensor at
their offsets (``os.pwrite``, straight from its local storage; from an accelerator through
a staging buffer of at most ``STAGING_BYTES``), rank 0 writes the replicated tensors (scales,
buffers), the index and the JSON configs, and only when every rank has written and synced
its part does rank 0 rename the directory into place. So the peak memory of a rank is its
own shard plus one staging buffer, and a failure anywhere leaves no checkpoint at the
target path: each step ends in an agreement, and every rank raises the same error.

    every rank plans (rank 0 also creates the files) -> agree -> every rank writes its rows
      (rank 0 also the replicated tensors and the JSON files) and syncs -> agree
      -> rank 0 renames the directory into place -> agree

Under HSDP (a 2-D ``(replicate, shard)`` mesh) every replica holds the same rows; only the
replica holding rank 0 writes them, so each row is written once, by one rank. The agreements
run on the loader's gloo side group with their own timeout (``fsdp_fp8.load.agreement``), not
on the default group, where NCCL's watchdog would abort instead of raising.

The target directory must be on a filesystem every rank sees (one node, or a shared one).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchao.quantization import Float8Tensor  # what quantize_model (runtime PTQ) makes of an fp8 weight

from fsdp_fp8.errors import ExportError, raise_if_problems
from fsdp_fp8.format import slice_reader
from fsdp_fp8.format.checkpoint import Checkpoint
from fsdp_fp8.format.sharding import staging_rows
from fsdp_fp8.format.step_policy import check_step_policy
from fsdp_fp8.format.writer import (
    STEM,
    CheckpointLayout,
    ShardWriter,
    TensorSpec,
    create_files,
    dtype_problems,
    plan_checkpoint,
    quantization_configs,
    write_index_and_configs,
)
from fsdp_fp8.fp8.tensor import E4M3, is_static_fp8
from fsdp_fp8.load.agreement import ASSUMED_WRITE_BYTES_PER_S, DEFAULT_TIMEOUT_S, distributed, exchange
from fsdp_fp8.load.api import LoadedModel
from fsdp_fp8.load.fsdp_wrap import primary_replica
from fsdp_fp8.load.loader import local_rows
from fsdp_fp8.load.plan import LoadPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveReport:
    """What one rank wrote."""

    directory: Path
    rank: int
    world_size: int
    tensors: int  # in the checkpoint
    files: int
    bytes_written: int  # tensor data written by this rank (its rows; rank 0 also the replicated tensors)
    staging_peak_bytes: int  # largest single copy from an accelerator (0 when the model is on CPU)
    seconds: float


@dataclass(frozen=True)
class _Item:
    """One tensor to write: ``rows`` is this rank's part (None: replicated, rank 0 writes ``value``)."""

    spec: TensorSpec
    rows: torch.Tensor | None = None  # this rank's rows of a Shard(0) tensor
    start: int = 0  # the global index of its first row
    value: torch.Tensor | None = None  # a replicated tensor, or a scale
    source: object | None = None  # a TensorEntry to copy (KV scales the model has no place for)


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _exchange(value: object, stage: str, directory: Path, timeout_s: float) -> list:
    """Every rank's ``value`` in rank order, on the agreements' gloo side group with its own
    timeout (``fsdp_fp8.load.agreement.exchange``); a failed or late peer is a ``PeerLostError``."""
    if not distributed():
        return [value]
    return exchange(value, timeout_s=timeout_s, stage=stage, context=f"saving {directory}")


def _persistent_buffers(model: nn.Module):
    for module_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buf


def _ptq_weight(key: str, local: torch.Tensor, input_scales, problems: list[str]):
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


def _writes_rows(tensor: DTensor) -> bool:
    """Whether this rank writes its rows of ``tensor``: under HSDP every replica holds the same
    rows, and only rank 0's replica writes them (each row once, by one rank)."""
    return dist.get_rank() in primary_replica(tensor.device_mesh)


def _collect(model: nn.Module, names: Mapping[str, str], input_scales, problems: list[str]) -> list[_Item]:
    items: list[_Item] = []
    for name, tensor in [*model.named_parameters(), *_persistent_buffers(model)]:
        key = names.get(name, name)
        local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
        if is_static_fp8(local) or isinstance(local, Float8Tensor):
            if isinstance(tensor, DTensor):
                _, start, stop = local_rows(tensor, name)
                stop = stop if _writes_rows(tensor) else start
            else:
                start, stop = 0, tensor.shape[0]
            if is_static_fp8(local):
                codes, w_scale, i_scale = local.qdata, local.scale.reshape(()), local.act_quant_scale.reshape(())
            else:
                found = _ptq_weight(key, local, input_scales, problems)
                if found is None:
                    continue
                codes, w_scale, i_scale = found
            stem = key.removesuffix(".weight")
            shape = tuple(tensor.shape)
            rows = codes[: stop - start] if isinstance(tensor, DTensor) else None
            items.append(
                _Item(TensorSpec(key, E4M3, shape), rows=rows, start=start, value=None if rows is not None else codes)
            )
            items.append(_Item(TensorSpec(f"{stem}.weight_scale", torch.float32, ()), value=w_scale))
            items.append(_Item(TensorSpec(f"{stem}.input_scale", torch.float32, ()), value=i_scale))
            continue
        if type(local) not in (torch.Tensor, nn.Parameter):
            problems.append(
                f"`{name}` is a {type(local).__name__}; only plain tensors and static-FP8 "
                "weights (Float8StaticLinear, TorchAO per-tensor Float8Tensor) can be saved"
            )
            continue
        if local.is_meta:
            problems.append(f"`{name}` is on the meta device; load or materialize the model before saving")
            continue
        spec = TensorSpec(key, tensor.dtype, tuple(tensor.shape))
        if isinstance(tensor, DTensor):
            rows, start, stop = local_rows(tensor, name)
            stop = stop if _writes_rows(tensor) else start
            items.append(_Item(spec, rows=rows[: stop - start] if tensor.ndim else rows, start=start))
        else:
            items.append(_Item(spec, value=tensor))
    return items


def _weight_stem(checkpoint: Checkpoint | None) -> str:
    if checkpoint is not None and any(name.startswith("model") for name in checkpoint.files):
        return "model"
    return STEM


def _configs(items, checkpoint, config, step_policy, problems) -> tuple[dict, dict | None]:
    base = dict(config if config is not None else checkpoint.config if checkpoint is not None else {})
    base.pop("quantization_config", None)
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
        return {k: base[k] for k in sorted(base)}, None
    ignore = (
        list(quant.ignore)
        if quant is not None and quant.is_modelopt_fp8
        else sorted(
            {
                i.spec.key.removesuffix(".weight")
                for i in items
                if i.spec.key.endswith(".weight") and i.spec.dtype != E4M3 and len(i.spec.shape) == 2
            }
        )
    )
    qc, hf_quant = quantization_configs(ignore, step_policy=step_policy, kv_cache=kv)
    full = {k: base[k] for k in sorted(base)}
    full["quantization_config"] = qc
    # A diffusers-style checkpoint has no hf_quant_config.json; keep the source's choice.
    if checkpoint is not None and not (checkpoint.directory / "hf_quant_config.json").exists():
        hf_quant = None
    return full, hf_quant


def _digest(layout: CheckpointLayout, config: dict, hf_quant: dict | None) -> str:
    h = hashlib.sha256(repr(layout.digest_fields()).encode())
    h.update(repr((sorted(config.items(), key=str), hf_quant)).encode())
    return h.hexdigest()


def _write_items(
    tmp: Path, layout: CheckpointLayout, items: list[_Item], rank: int, staging_bytes: int
) -> tuple[int, int]:
    """This rank's part of the data: (bytes written, largest single staging copy; 0 on CPU)."""
    staged = 0
    with ShardWriter(tmp, layout) as writer:
        for item in items:
            key = item.spec.key
            if item.source is not None:
                if rank == 0:
                    writer.write_tensor(key, slice_reader.read_bytes(item.source, 0, 1))
                continue
            if item.rows is None:
                if rank == 0:
                    writer.write_tensor(key, item.value.detach().reshape(item.spec.shape).cpu())
                continue
            rows = item.rows
            if rows.numel() == 0:
                continue
            row_bytes = layout.tensors[key].row_bytes
            step = rows.shape[0] if rows.device.type == "cpu" else staging_rows(row_bytes, staging_bytes)
            for lo in range(0, rows.shape[0], step):
                chunk = rows[lo : lo + step]
                if chunk.device.type != "cpu":
                    chunk = chunk.to("cpu")
                    staged = max(staged, chunk.numel() * chunk.element_size())
                writer.write_tensor(key, chunk, item.start + lo)
    return writer.bytes_written, staged


@dataclass
class _Prepared:
    items: list[_Item]
    layout: CheckpointLayout | None  # None when there are problems
    config: dict
    hf_quant: dict | None
    digest: str | None


def _prepare(
    model: nn.Module,
    directory: Path,
    checkpoint: Checkpoint | None,
    plan: LoadPlan | None,
    config,
    input_scales,
    step_policy,
    max_shard_size,
    problems: list[str],
) -> _Prepared:
    """Everything one rank decides alone, before any collective: what to write, where, and problems."""
    if checkpoint is None and config is None:
        problems.append("pass `config` (the model's config dict) or the `source` it was loaded from")
    if getattr(model, "fsdp_fp8_unusable", None):
        problems.append(f"the model did not finish loading and must not be saved: {model.fsdp_fp8_unusable}")
    names: dict[str, str] = {}  # model name -> checkpoint key, as the load planned it
    if plan is not None:
        names.update({f"{t.module}.weight": t.entry.weight.key for t in plan.fp8})
        names.update({t.name: t.entry.key for t in plan.tensors})
    items = _collect(model, names, input_scales, problems)
    held = {i.spec.key for i in items}
    # KV-cache scales of the source the model has no tensor for (a transformers Llama keeps its
    # KV cache in the model dtype): copied from the source files.
    for key in plan.kv_scales if plan is not None else checkpoint.kv_scales if checkpoint is not None else ():
        entry = checkpoint.kv_scales[key]
        if key not in held:
            items.append(_Item(TensorSpec(key, entry.torch_dtype, entry.shape), source=entry))
    counts = Counter(i.spec.key for i in items)
    problems += [
        f"`{k}` would be written {n} times (several model tensors map to it)" for k, n in counts.items() if n > 1
    ]
    dtype_problems((i.spec for i in items), problems)
    full_config, hf_quant = _configs(items, checkpoint, config, step_policy, problems)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        problems.append(f"{directory} exists and is not an empty directory; save writes a new checkpoint")
    if problems:
        return _Prepared(items, None, full_config, hf_quant, None)
    layout = plan_checkpoint((i.spec for i in items), stem=_weight_stem(checkpoint), max_shard_size=max_shard_size)
    return _Prepared(items, layout, full_config, hf_quant, _digest(layout, full_config, hf_quant))


def save_checkpoint(
    model: nn.Module | LoadedModel,
    directory: str | os.PathLike,
    *,
    source: LoadedModel | Checkpoint | None = None,
    config: dict | None = None,
    input_scales: Mapping[str, float | torch.Tensor] | None = None,
    step_policy: dict | None = None,
    max_shard_size: int | None = None,
    staging_bytes: int | None = None,
    agreement_timeout_s: float = DEFAULT_TIMEOUT_S,
) -> SaveReport:
    """Write ``model`` as a ModelOpt static-FP8 checkpoint in ``directory`` (absent or empty).

    Collective over the default process group when one is up: every rank must call it, and
    each writes only its own rows. ``model`` is an ``nn.Module`` (sharded with ``fully_shard``
    or not) or the ``LoadedModel`` that ``load_model`` returned. ``source`` (default: that
    ``LoadedModel``) is what the model was loaded from: its ``config.json``, ignore list, step
    policy, KV-cache scales (also those the model has no tensor for) and file stem are kept,
    and a ``LoadedModel``'s plan maps the model's names back to the checkpoint's keys.
    ``config`` (the model config dict) replaces the source's ``config.json``, and is needed
    without a source; its ``quantization_config``, if any, is written anew. ``input_scales``
    gives the static input scale (``amax(|x|) / 448``) of each runtime-quantized linear
    (``quantize_model(..., granularity="per_tensor")``), which quantizes its input dynamically.
    ``step_policy`` replaces the source's. ``max_shard_size`` bounds each shard file's tensor
    bytes (one file when None); ``staging_bytes`` bounds each copy from an accelerator
    (default ``slice_reader.STAGING_BYTES``). Everything is checked before anything is written:
    every rank raises the same ``ExportError``; a lost peer raises ``PeerLostError``. Nothing
    is left at ``directory`` unless the save completed on every rank.

    Under HSDP (a 2-D mesh) only the replica holding rank 0 writes rows; the other replicas
    take part in the agreements and write nothing. The agreements run on the load's gloo side
    group: a rank waits ``agreement_timeout_s`` for its peers, and for the outcome of the writes
    that plus the time the whole save's bytes take at ``agreement.ASSUMED_WRITE_BYTES_PER_S``
    (every rank may be writing into one shared filesystem at once).
    """
    t0 = time.perf_counter()
    rank, world = _rank_world()
    directory = Path(directory)
    staging_bytes = slice_reader.STAGING_BYTES if staging_bytes is None else staging_bytes
    if isinstance(model, LoadedModel):
        source = model if source is None else source
        model = model.model
    checkpoint, plan = (source.checkpoint, source.plan) if isinstance(source, LoadedModel) else (source, None)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # FSDP2 keeps the root unsharded after a forward: save the shards
    problems: list[str] = []
    prepared = _prepare(model, directory, checkpoint, plan, config, input_scales, step_policy, max_shard_size, problems)
    layout, tmp = prepared.layout, None
    if rank == 0 and not problems:
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
            create_files(tmp, layout)
        except OSError as exc:
            problems.append(f"cannot create the checkpoint files next to {directory}: {exc}")
    try:
        # Everything this rank will write: its rows, and on rank 0 the replicated tensors too.
        to_write = sum(
            i.rows.numel() * i.rows.element_size() if i.rows is not None else (i.spec.nbytes if rank == 0 else 0)
            for i in prepared.items
        )
        verdicts = _exchange(
            (rank, sorted(problems), prepared.digest, tmp and str(tmp), to_write),
            "agreement on the planned files",
            directory,
            agreement_timeout_s,
        )
        merged = [f"rank {r}: {p}" if world > 1 else p for r, found, _, _, _ in verdicts for p in found]
        if len({digest for _, found, digest, _, _ in verdicts if not found}) > 1:
            merged.append("ranks planned different files (model shapes, dtypes or configs differ between ranks)")
        raise_if_problems(merged, f"cannot save {directory}", ExportError)
        shared_tmp = Path(verdicts[0][3])  # rank 0 made it; every rank writes into it
        ok, message, written, staged = True, "", 0, 0
        try:
            written, staged = _write_items(shared_tmp, layout, prepared.items, rank, staging_bytes)
            if rank == 0:
                write_index_and_configs(shared_tmp, layout, prepared.config, prepared.hf_quant)
        except Exception as exc:  # every rank must learn of it before anyone moves on
            ok, message = False, f"{type(exc).__name__}: {exc}"
        everything = sum(n for *_, n in verdicts)
        outcomes = _exchange(
            (rank, ok, message),
            "agreement on the written rows",
            directory,
            agreement_timeout_s + everything / ASSUMED_WRITE_BYTES_PER_S,
        )
        failed = [f"rank {r}: {m}" for r, rank_ok, m in outcomes if not rank_ok]
        raise_if_problems(failed, f"saving {directory} failed; nothing was left there", ExportError)
        moved = ""
        if rank == 0:
            try:
                if directory.exists():
                    directory.rmdir()  # empty (checked above): rename replaces no directory portably
                os.rename(tmp, directory)
                tmp = None
            except OSError as exc:
                moved = f"rank 0: cannot move the finished checkpoint into place: {exc}"
        (_, moved), *_ = _exchange((rank, moved), "agreement on moving it into place", directory, agreement_timeout_s)
        raise_if_problems([moved] if moved else [], f"saving {directory} failed", ExportError)
    finally:
        if tmp is not None:  # rank 0, on any failure: no half-written checkpoint stays behind
            shutil.rmtree(tmp, ignore_errors=True)
    if rank == 0:
        log.info("saved %s: %d tensors in %d files", directory, len(layout.tensors), len(layout.files))
    return SaveReport(
        directory, rank, world, len(layout.tensors), len(layout.files), written, staged, time.perf_counter() - t0
    )
