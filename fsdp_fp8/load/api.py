"""The load's steps that ``fsdp_fp8.load_model`` (``fsdp_fp8.interop.load``) composes, and
what it returns (``LoadedModel``): join the ranks, build on meta and plan into a
``PlannedLoad``, then ``load_planned``: ranks agree -> start prefetch -> one collective phase:
swap FP8 linears, fully_shard (blocks, then root), to_empty (non-persistent buffers kept),
stop prefetch, rank-slice reads -> one agreement on the outcome.

Which class a ``config.json`` names and the tower map sit above this layer (``interop``,
``runtime``); they reach the load only as a ``model_fn`` and the problems of a ``PlannedLoad``.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from fsdp_fp8.collective import (
    agree_or_raise,
    checkpoint_facts,
    collective_phase,
    mark_unusable,
    model_facts,
    outcome_timeout_s,
    plan_facts,
    side_group,
)
from fsdp_fp8.collective import distributed as _many_ranks
from fsdp_fp8.errors import CheckpointError
from fsdp_fp8.format.checkpoint import Checkpoint
from fsdp_fp8.format.read_options import ReadOptions
from fsdp_fp8.fp8.linear import cuda_shape_problems
from fsdp_fp8.load.fsdp_wrap import default_mesh, mesh_position, mesh_problems, offloads_to_cpu, shard_model
from fsdp_fp8.load.loader import LoadReport, load_report, read_rows
from fsdp_fp8.load.meta_build import materialize, meta_init
from fsdp_fp8.load.plan import LoadPlan, plan_load
from fsdp_fp8.load.prefetch import start_prefetch
from fsdp_fp8.load.preflight import device_facts, device_problems, ensure_process_group
from fsdp_fp8.load.release import release_model
from fsdp_fp8.load.swap import swap_fp8_linears

if TYPE_CHECKING:  # the layer above: a LoadedModel only carries what it resolved
    from fsdp_fp8.interop.architectures import Architecture

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A loaded model and what it was loaded from. ``close()`` (or leaving ``with load_model(...)
    as loaded:``) lets it go at once: ``fsdp_fp8.load.release``."""

    model: nn.Module
    checkpoint: Checkpoint
    plan: LoadPlan
    report: LoadReport
    fp8_linears: list[str]
    architecture: Architecture | None = None  # set when load_model resolved the model from config.json
    towers: dict[str, str] | None = None  # linear name -> tower (fsdp_fp8.runtime.towers), when one is known

    def close(self) -> None:
        """Free every storage the load made on this rank now (not when the garbage collector
        finds FSDP2's reference cycles), close the checkpoint's files, and leave the model
        refusing to run or be saved. Local: every rank closes its own. A second call does nothing."""
        release_model(self.model)
        self.checkpoint.close()

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def local_cuda_index() -> int:
    """This process's GPU: torchrun's ``LOCAL_RANK`` modulo the GPUs this process sees.

    A launcher that hands each rank its own ``CUDA_VISIBLE_DEVICES`` leaves one visible GPU
    per process while ``LOCAL_RANK`` still counts the node's ranks: the modulo maps rank 3 to
    its one GPU (index 0) instead of asking for a ``cuda:3`` that does not exist.
    """
    return int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_cuda_index())
    return torch.device("cpu")


@dataclass
class PlannedLoad:
    """What a load knows before the ranks agree: every field the steps got to (``None`` past
    the first that failed) and every problem that refuses the load. Filled step by step by
    ``fsdp_fp8.interop.load.plan_model_load`` (open, class, ``plan_on_meta``, tower map)."""

    checkpoint: Checkpoint | None = None
    model: nn.Module | None = None  # on meta
    plan: LoadPlan | None = None
    architecture: Architecture | None = None
    problems: list[str] = field(default_factory=list)
    towers: dict[str, str] | None = None  # the tower map (fsdp_fp8.runtime.towers), when one is known
    cause: BaseException | None = None  # an unexpected exception (e.g. in model_fn), kept for its traceback

    def refuse(self, exc: Exception) -> None:
        """``exc`` as a problem the other ranks learn in the agreement (a rank that raised here
        would strand them in it); an unexpected one is kept as ``cause`` for its traceback."""
        if isinstance(exc, CheckpointError):
            self.problems += exc.problems
            return
        where = traceback.extract_tb(exc.__traceback__)[-1]
        self.problems.append(f"{type(exc).__name__}: {exc} (raised at {where.filename}:{where.lineno} in {where.name})")
        self.cause = exc  # the CheckpointError raised after the agreement chains it: the user's frame shows


def plan_on_meta(
    planned: PlannedLoad,
    model_fn: Callable[[dict], nn.Module],
    key_map: Callable[[str], str | None] | None = None,
    *,
    device: torch.device,
    strict: bool = True,
    strict_kv_scales: bool = False,
) -> None:
    """Build ``model_fn(config)`` on meta and plan it against ``planned.checkpoint`` (opened),
    into ``planned``: the model is kept before the plan, so a refused plan still marks it
    unusable. Raises what ``model_fn`` or ``plan_load`` raise (``PlannedLoad.refuse`` keeps it);
    touches no process group and reads no tensor data beyond the scales."""
    checkpoint = planned.checkpoint
    with meta_init():
        planned.model = model_fn(checkpoint.config)
    planned.plan = plan_load(
        checkpoint, planned.model, key_map=key_map, strict=strict, strict_kv_scales=strict_kv_scales
    )
    if device.type == "cuda":
        planned.problems += cuda_shape_problems(planned.plan.fp8)


def join_ranks(path: str | os.PathLike, agreement_timeout_s: float) -> None:
    """Before any rank can fail or die: a process group under torchrun (never a silent
    unsharded load per rank), and the gloo side group the agreements run on (collective)."""
    ensure_process_group(agreement_timeout_s)
    if _many_ranks():
        side_group(agreement_timeout_s, f"cannot load {path}")


def load_planned(
    planned: PlannedLoad,
    path: str | os.PathLike,
    mesh: DeviceMesh | None,
    *,
    device: torch.device,
    agreement_timeout_s: float,
    read_options: ReadOptions,
    mp_policy: MixedPrecisionPolicy | None,
    offload_policy: OffloadPolicy | None,
    reshard_after_forward: bool | int,
) -> LoadedModel:
    """The load after each rank planned alone: agree (problems + digests) -> start prefetch ->
    one collective_phase: swap, shard, materialize, stop prefetch, read rows. ``path`` names
    the load in its errors; ``fsdp_fp8.load_model`` documents the other arguments and holds
    their defaults (every one is passed here)."""
    distributed = dist.is_available() and dist.is_initialized()
    planned.problems[:0] = _setup_problems(device, mesh, distributed, planned.plan)
    _agree_on_plan(planned, device, mesh, f"cannot load {path}", agreement_timeout_s)
    model, plan, checkpoint = planned.model, planned.plan, planned.checkpoint
    _warn_not_strict(plan)
    fsdp_options = _fsdp_options(mp_policy, offload_policy, reshard_after_forward, distributed)
    on_host = offloads_to_cpu(offload_policy) and distributed  # sharded parameters live in host memory
    shards, shard = _shard_position(mesh, distributed)  # the rows this rank will hold once sharded
    timeout_s = outcome_timeout_s(plan, shards, agreement_timeout_s)
    prefetch = start_prefetch(plan, shards, shard, read_options.prefetch_bytes)
    try:
        with collective_phase(model, "load", timeout_s, failed="checkpoint load failed"):
            swapped = swap_fp8_linears(model, plan)
            if distributed:
                shard_model(model, mesh or default_mesh(device.type), **fsdp_options)
            materialize(model, torch.device("cpu") if on_host else device)  # keeps buffers and ties
            if on_host:
                _buffers_to(model, device)
            prefetched = prefetch.stop()
            t0 = time.perf_counter()
            rows = read_rows(model, plan, read_options)
    except BaseException:
        prefetch.stop()
        checkpoint.close()  # the model is dead: its descriptors go too
        raise
    report = load_report(rows, plan, time.perf_counter() - t0, prefetched)
    # On success the descriptors stay with LoadedModel.checkpoint (save_checkpoint reads the
    # source through them); checkpoint.close() or garbage collection releases them.
    model.eval()
    return LoadedModel(model, checkpoint, plan, report, swapped, planned.architecture, planned.towers)


def _agree_on_plan(planned: PlannedLoad, device: torch.device, mesh, context: str, timeout_s: float) -> None:
    """The agreement before anything changes: every rank's problems and the digests of what it
    read and built. On a refusal the model refuses to run and the files are closed."""
    facts = None
    if planned.plan is not None:  # else this rank has a problem, which the others learn in the agreement
        facts = {
            **checkpoint_facts(planned.checkpoint),
            "load plan": plan_facts(planned.plan),
            **model_facts(planned.model, device, mesh),
        }
    try:
        agree_or_raise(planned.problems, facts, context, timeout_s=timeout_s)
    except BaseException as exc:
        if planned.model is not None:  # refused: nothing was changed, and nothing may run either
            mark_unusable(planned.model, str(exc))
        if planned.checkpoint is not None:
            planned.checkpoint.close()
        if isinstance(exc, CheckpointError) and planned.cause is not None:
            raise exc from planned.cause  # the traceback of the user's line (model_fn) shows under it
        raise


def _fsdp_options(mp_policy, offload_policy, reshard_after_forward, distributed: bool) -> dict:
    """The ``fully_shard`` options the caller set (only those: the defaults stay FSDP2's); a
    warning when there is no process group to shard over, so they are ignored."""
    options = {
        name: value
        for name, value, default in (
            ("mp_policy", mp_policy, None),
            ("offload_policy", offload_policy, None),
            ("reshard_after_forward", reshard_after_forward, True),
        )
        if value is not default
    }
    if options and not distributed:
        log.warning("no process group: the model is not sharded and %s are ignored", ", ".join(sorted(options)))
    return options


def _buffers_to(model: nn.Module, device: torch.device) -> None:
    """Every buffer onto ``device`` (FSDP2 offloads parameters only; the forward runs there)."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


def _shard_position(mesh: DeviceMesh | None, distributed: bool) -> tuple[int, int]:
    """(shard-dim size, this rank's shard coordinate) the model will have once sharded over
    ``mesh`` (default: every rank); what the prefetch hints and the outcome timeout is sized from."""
    if not distributed:
        return 1, 0
    return mesh_position(mesh) if mesh is not None else (dist.get_world_size(), dist.get_rank())


def _setup_problems(device: torch.device, mesh: DeviceMesh | None, distributed: bool, plan) -> list[str]:
    """What would make the first collective hang or land on the wrong device (the mesh; the
    GPU's capability, two ranks on one GPU, the device passed vs the current one)."""
    problems = []
    if mesh is not None:
        world = dist.get_world_size() if distributed else 1
        problems += [f"mesh: {p}" for p in mesh_problems(mesh, device.type, world)]
    return problems + device_problems(device_facts(device, len(plan.fp8) if plan is not None else 0))


def _warn_not_strict(plan) -> None:
    """With strict=False, what stays unfilled (uninitialized memory) or unused is said aloud."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0 and plan.missing:
        log.warning(
            "strict=False: %d model tensors are in no checkpoint file and stay uninitialized: %s",
            len(plan.missing),
            ", ".join(plan.missing[:20]),
        )
    if rank0 and plan.unexpected:
        log.warning(
            "strict=False: %d checkpoint tensors have no place in the model and are not loaded: %s",
            len(plan.unexpected),
            ", ".join(plan.unexpected[:20]),
        )
