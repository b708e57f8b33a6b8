"""The rank-slice loader: each rank reads only its own rows, straight into its local storage.

Reading is purely local (no collective per tensor): a rank works out which rows of each
tensor its DTensor shard owns (``torch.chunk`` semantics, uneven and empty shards
included), preads exactly those bytes from the safetensors file into the shard's storage
(through a bounded staging buffer when the storage is on an accelerator), and fills the
per-tensor scales. One small collective at the end makes every rank agree on the outcome,
so a failure on any rank raises on all of them and no rank keeps a half-loaded model.
If that collective itself fails (a peer died mid-load) or times out (a peer hangs; bounded
by the process-group timeout the launcher sets), this rank marks the model unusable and
raises a ``RuntimeError`` saying so: the model is never left usable after a failed load.
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fsdp_fp8.errors import LoadFailedError, ModelUnusableError, PeerLostError
from fsdp_fp8.format import slice_reader
from fsdp_fp8.load.agreement import merge_rank_problems
from fsdp_fp8.load.meta_build import tensors_on_meta
from fsdp_fp8.load.progress import LoadProgress
from fsdp_fp8.format.sharding import staging_rows

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class LoadReport:
    """What one rank loaded, read and held."""

    rank: int
    world_size: int
    fp8_linears: int
    tensors: int
    bytes_read: int
    bytes_held: int
    seconds: float  # the load after ``prepare``: the reads and the agreement on their outcome
    read_seconds: float  # the reads alone: what GB/s is measured over (waiting for peers is not I/O)
    peak_rss_bytes: int
    peak_device_bytes: int | None

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds > 0 else 0.0


def local_rows(param: torch.Tensor, name: str = "tensor") -> tuple[torch.Tensor, int, int]:
    """This rank's storage of ``param`` and the global row range ``[start, stop)`` it holds."""
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        if tuple(shape[1:]) != tuple(param.shape[1:]):
            raise NotImplementedError(
                f"`{name}` is sharded as {param.placements} (local shape {tuple(shape)} of "
                f"{tuple(param.shape)}); only dim-0 sharding (FSDP2's Shard(0)) is loaded"
            )
        local = param._local_tensor
        rows = shape[0] if len(shape) else 1
        start = offset[0] if len(offset) and rows else 0
        return local, start, start + rows
    return param, 0, (param.shape[0] if param.ndim else 1)


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    assert t.is_contiguous(), "loader writes into contiguous storage only"
    return t.reshape(-1).view(torch.uint8)


def _read_rows_into(entry, start: int, stop: int, dest: torch.Tensor) -> None:
    """Fill ``dest`` (any dtype, contiguous) with rows [start, stop) of ``entry``'s bytes."""
    if stop <= start:
        return
    dest_bytes = _byte_view(dest)
    if dest_bytes.device.type == "cpu":
        slice_reader.read_bytes(entry, start, stop, out=dest_bytes)
        return
    row_bytes = dest_bytes.numel() // (stop - start)
    step = staging_rows(row_bytes, slice_reader.STAGING_BYTES)  # shared with the forecast (sharding.rank_forecast)
    for lo in range(start, stop, step):
        hi = min(stop, lo + step)
        staged = slice_reader.read_bytes(entry, lo, hi).reshape(-1).view(torch.uint8)
        dest_bytes[(lo - start) * row_bytes : (hi - start) * row_bytes].copy_(staged)


def _named_tensor(model: nn.Module, name: str) -> torch.Tensor:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        return module._parameters[leaf]
    if leaf in module._buffers:
        return module._buffers[leaf]
    raise KeyError(f"`{name}` is neither a parameter nor a buffer of the model (was it changed after planning?)")


def _load_local(model: nn.Module, plan) -> tuple[int, int]:
    """Every read this rank does; returns (bytes held by the targets, number of tensors)."""
    held = 0
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    progress = LoadProgress(plan.rank_bytes(world, rank), enabled=rank == 0)
    read_before = slice_reader.bytes_read()
    with torch.no_grad():
        for target in plan.fp8:
            weight = model.get_submodule(target.module).weight
            local, start, stop = local_rows(weight, f"{target.module}.weight")
            _read_rows_into(target.entry.weight, start, stop, local.qdata)
            local.scale.copy_(slice_reader.read_scale(target.entry.weight_scale).reshape(1, 1))
            local.act_quant_scale.copy_(slice_reader.read_scale(target.entry.input_scale).reshape(1, 1))
            held += local.qdata.numel() + 8
            progress.update(slice_reader.bytes_read() - read_before)
        for target in plan.tensors:
            local, start, stop = local_rows(_named_tensor(model, target.name), target.name)
            _read_rows_into(target.entry, start, stop, local)
            held += local.numel() * local.element_size()
            progress.update(slice_reader.bytes_read() - read_before)
    progress.close()
    return held, len(plan.fp8) + len(plan.tensors)


def _mark_unusable(model: nn.Module, reason: str) -> None:
    def refuse(module, args):
        raise ModelUnusableError(f"this model did not finish loading and must not be used: {reason}")

    # prepend: FSDP2's root pre-forward hook (lazy init, then an all-gather) would otherwise
    # run first, and with a dead or absent peer that collective hangs or fails in gloo
    # instead of this clear refusal.
    model.register_forward_pre_hook(refuse, prepend=True)
    model.fsdp_fp8_unusable = reason


def _agree(ok: bool, message: str) -> list[tuple[int, str]]:
    """Every rank's failure (rank, message); a single process just reports its own."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [] if ok else [(0, message)]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dist.get_rank(), ok, message))
    return [(rank, msg) for rank, rank_ok, msg in gathered if not rank_ok]


def load_checkpoint(model: nn.Module, plan, *, prepare=None) -> LoadReport:
    """Fill a swapped, sharded and materialized model following ``plan`` (from ``plan_load``),
    which names the checkpoint and every entry to read.

    Collective over the default process group when one is initialized. On any rank's
    failure every rank raises the same error and the model's forward refuses to run.
    ``prepare``, if given, runs first inside that agreement (``load_model`` passes the swap,
    ``fully_shard`` and ``to_empty``, so a rank failing there fails every rank too).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    read_before = slice_reader.bytes_read()
    t0 = time.perf_counter()
    ok, message, held, count, read_s = True, "", 0, 0, 0.0
    try:
        if prepare is not None:
            prepare()
            read_before, t0 = slice_reader.bytes_read(), time.perf_counter()
        on_meta = tensors_on_meta(model)
        if on_meta:
            raise RuntimeError(f"materialize the model before loading; still on meta: {on_meta[:5]}")
        t_read = time.perf_counter()
        held, count = _load_local(model, plan)
        read_s = time.perf_counter() - t_read
        left = tensors_on_meta(model)
        assert not left, left
    except Exception as exc:  # every rank must learn of it: re-raised below after agreement
        ok, message = False, f"{type(exc).__name__}: {exc}"
        log.error("rank %d: load failed: %s", rank, message)
    try:
        failures = _agree(ok, message)
    except Exception as exc:  # a peer died, hung past the process-group timeout, or dropped out
        reason = (f"rank {rank} could not agree on the outcome with the other ranks (a peer died, "
                  f"failed or hung past the process-group timeout): {type(exc).__name__}: {exc}")
        if not ok:
            reason = f"rank {rank}: {message}; {reason}"
        _mark_unusable(model, reason)
        raise PeerLostError(f"checkpoint load failed: {reason}") from exc
    if failures:
        problems = merge_rank_problems(failures, world)
        _mark_unusable(model, "; ".join(problems))
        raise LoadFailedError(problems, f"checkpoint load failed on {len(failures)} of {world} ranks")
    device_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return LoadReport(
        rank=rank,
        world_size=world,
        fp8_linears=len(plan.fp8),
        tensors=count,
        bytes_read=slice_reader.bytes_read() - read_before,
        bytes_held=held,
        seconds=time.perf_counter() - t0,
        read_seconds=read_s,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        peak_device_bytes=device_peak,
    )
