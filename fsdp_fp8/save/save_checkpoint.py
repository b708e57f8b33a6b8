"""``save_checkpoint``: write a (sharded) model back as a ModelOpt static-FP8 checkpoint.

Nothing is gathered. ``plan_save`` runs on every rank alone; rank 0 makes the temporary directory
and the files; one agreement on the plan; phase "writes": every rank writes its own rows
(``pwrite``); phase "move into place": rank 0 renames the directory over the target. Each phase
is one ``collective_phase``, so a failure anywhere raises the same ``ExportError`` on every rank
and leaves nothing at the target.

A rank's peak is its own shard plus one staging buffer. Under HSDP only the replica holding rank 0
writes, so each row is written once. The target must be on a filesystem every rank sees.

Usage: docs/usage.md, "Saving a model as a ModelOpt checkpoint"; crashes: docs/reliability.md, "Saves".
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp_fp8.collective import (
    ASSUMED_WRITE_BYTES_PER_S,
    DEFAULT_TIMEOUT_S,
    agree_or_raise,
    collective_phase,
    rank_and_world,
    unusable_reason,
)
from fsdp_fp8.errors import ExportError
from fsdp_fp8.format.checkpoint import Checkpoint
from fsdp_fp8.format.writer import create_files, write_index_and_configs
from fsdp_fp8.load.loaded import LoadedModel
from fsdp_fp8.reading.read_options import DEFAULT_STAGING_BYTES
from fsdp_fp8.save.destination import destination_problems, space_problem
from fsdp_fp8.save.plan import SavePlan, plan_save
from fsdp_fp8.save.source_files import SourceFiles, copy_source_files, source_files
from fsdp_fp8.save.temp_dir import Cleaning, clean_leftovers, make_temp_dir, move_into_place
from fsdp_fp8.save.write import write_rank_part

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveReport:
    """What one rank wrote (rank 0 also what it cleaned and carried)."""

    directory: Path
    rank: int
    world_size: int
    tensors: int  # in the checkpoint
    files: int
    bytes_written: int  # tensor data written by this rank (its rows; rank 0 also the replicated tensors)
    staging_peak_bytes: int  # largest single copy from an accelerator (0 when the model is on CPU)
    seconds: float
    removed_leftovers: tuple[str, ...] = ()  # temporary directories of dead saves removed (rank 0)
    carried: tuple[str, ...] = ()  # the source's non-weight files copied (rank 0)
    not_carried: tuple[str, ...] = ()  # "name (why)" for the source's files not copied (rank 0)


@dataclass
class _Begun:
    """What rank 0 set up before the agreement: the temporary directory (None elsewhere)."""

    tmp: Path | None = None
    cleaning: Cleaning = field(default_factory=Cleaning)
    files: SourceFiles = field(default_factory=lambda: SourceFiles(None))


def _unpack(model, source) -> tuple[nn.Module, Checkpoint | None, object]:
    if isinstance(model, LoadedModel):
        source = model if source is None else source
        model = model.model
    if isinstance(source, LoadedModel):
        return model, source.checkpoint, source.plan
    return model, source, None


def _reshard(model: nn.Module) -> None:
    """FSDP2 keeps the root unsharded after a forward: the save writes the shards."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _begin(directory: Path, plan: SavePlan, checkpoint: Checkpoint | None, problems: list[str]) -> _Begun:
    """Rank 0, when nothing is wrong: clean up after dead saves, make the temporary directory and
    its files. An ``OSError`` is a problem for the agreement, not an exception."""
    begun = _Begun()
    if plan.rank != 0 or problems:
        return begun
    try:
        if directory.parent.is_dir():
            begun.cleaning = clean_leftovers(directory.parent)
            for line in begun.cleaning.lines():
                log.warning("%s", line)
        begun.files = source_files(checkpoint.directory if checkpoint is not None else None)
        needed = sum(f.size for f in plan.layout.files) + begun.files.bytes()
        short = space_problem(directory, needed)
        if short:
            problems.append(short)
            return begun
        begun.tmp = make_temp_dir(directory)
        create_files(begun.tmp, plan.layout)
    except OSError as exc:
        problems.append(f"cannot create the checkpoint files next to {directory}: {exc}")
    return begun


def _agree_on_plan(plan: SavePlan, problems: list[str], begun: _Begun, directory: Path, timeout_s: float):
    """(the temporary directory rank 0 made, every rank's bytes to write): the one agreement on the
    planned files (``agree_or_raise``, with those two travelling in the same exchange), or the same
    ``ExportError`` on every rank (a problem anywhere, or ranks that planned different files)."""
    facts = None if problems else {"the planned files": {"layout digest": plan.digest}}
    shared = agree_or_raise(
        problems,
        facts,
        f"cannot save {directory}",
        timeout_s,
        share=(begun.tmp and str(begun.tmp), plan.bytes_to_write),
        error=ExportError,
        stage="agreement on the planned files",
    )
    return Path(shared[0][0]), sum(nbytes for _, nbytes in shared)


def _phase(stage: str, directory: Path, timeout_s: float, failed: str | None = None):
    """One collective phase of the save: every rank raises the same ``ExportError`` on failure."""
    return collective_phase(
        None,
        f"save's {stage}",
        timeout_s,
        failed=failed or f"nothing was saved at {directory}: the {stage} failed",
        error=ExportError,
    )


def _move_failed(directory: Path) -> str:
    """The move's failure text: rank 0 may have renamed before a peer was lost, so the
    checkpoint may be whole; say how to tell instead of "nothing was saved"."""
    return (
        f"the move into place of {directory} failed: if rank 0 renamed it before the failure "
        f"{directory} holds the whole checkpoint (check it: fsdp-fp8 verify {directory}); else nothing was saved"
    )


def _report(directory, plan, world, written, staged, begun, t0) -> SaveReport:
    if plan.rank == 0:
        log.info("saved %s: %d tensors in %d files", directory, len(plan.layout.tensors), len(plan.layout.files))
        for line in begun.files.lines():
            log.warning("%s", line)
    return SaveReport(
        directory,
        plan.rank,
        world,
        len(plan.layout.tensors),
        len(plan.layout.files),
        written,
        staged,
        time.perf_counter() - t0,
        tuple(str(x.path) for x in begun.cleaning.removed),
        begun.files.carried,
        tuple(f"{name} ({why})" for name, why in begun.files.not_carried),
    )


def save_checkpoint(
    model: nn.Module | LoadedModel,
    directory: str | os.PathLike,
    *,
    source: LoadedModel | Checkpoint | None = None,
    config: dict | None = None,
    input_scales: Mapping[str, float | torch.Tensor] | None = None,
    step_policy: dict | None = None,
    max_shard_size: int | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> SaveReport:
    """Write ``model`` as a ModelOpt static-FP8 checkpoint in ``directory`` (absent or empty).

    Collective over the default process group when one is up: every rank must call it, and
    each writes only its own rows. ``model`` is an ``nn.Module`` (sharded with ``fully_shard``
    or not) or the ``LoadedModel`` that ``load_model`` returned. ``source`` (default: that
    ``LoadedModel``) is what the model was loaded from: its ``config.json``, ignore list, step
    policy, KV-cache scales (also those the model has no tensor for), file stem and non-weight
    files (``generation_config.json``, tokenizer files, ...) are kept, and a ``LoadedModel``'s
    plan maps the model's names back to the checkpoint's keys. ``config`` (the model config
    dict) replaces the source's ``config.json``, and is needed without a source; its
    ``quantization_config``, if any, is written anew. ``input_scales`` gives the static input
    scale (``amax(|x|) / 448``) of each runtime-quantized linear (``quantize_model(...,
    granularity="per_tensor")``), which quantizes its input dynamically. ``step_policy``
    replaces the source's. ``max_shard_size`` bounds each shard file's tensor bytes (one file
    when None); ``staging_bytes`` bounds each copy from an accelerator (default
    ``DEFAULT_STAGING_BYTES``, 64 MiB, the load's staging size too). Everything is checked before anything is written: every
    rank raises the same ``ExportError``; a lost peer raises ``PeerLostError``. Nothing is left
    at ``directory`` unless the save completed on every rank.

    Under HSDP (a 2-D mesh) only the replica holding rank 0 writes rows; the other replicas
    take part in the agreements and write nothing. A rank waits ``timeout_s`` for its
    peers, and for the outcome of the writes that plus the time the whole save's bytes take at
    ``ASSUMED_WRITE_BYTES_PER_S`` (every rank may be writing into one shared filesystem at once).
    """
    t0 = time.perf_counter()
    directory = Path(directory)
    model, checkpoint, load_plan = _unpack(model, source)
    _reshard(model)
    _, world = rank_and_world()
    plan = plan_save(
        model,
        checkpoint=checkpoint,
        load_plan=load_plan,
        config=config,
        input_scales=input_scales,
        step_policy=step_policy,
        max_shard_size=max_shard_size,
        unusable=unusable_reason(model),
    )
    problems = [*plan.problems, *destination_problems(directory)]
    begun = _begin(directory, plan, checkpoint, problems)
    moved = False
    try:
        tmp, everything = _agree_on_plan(plan, problems, begun, directory, timeout_s)
        with _phase("writes", directory, timeout_s + everything / ASSUMED_WRITE_BYTES_PER_S):
            written, staged = write_rank_part(tmp, plan, staging_bytes)
            if plan.rank == 0:
                write_index_and_configs(tmp, plan.layout, plan.config, plan.hf_quant)
                copy_source_files(begun.files, tmp)
        with _phase("move into place", directory, timeout_s, _move_failed(directory)):
            if plan.rank == 0:
                move_into_place(tmp, directory)
                moved = True
    finally:
        if begun.tmp is not None and not moved:  # rank 0, on any failure: no half-written checkpoint stays
            shutil.rmtree(begun.tmp, ignore_errors=True)
    return _report(directory, plan, world, written, staged, begun, t0)
