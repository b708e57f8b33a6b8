"""The rank-slice loader: each rank reads only its own rows, straight into its local storage.

:func:`read_rows` works out which rows of each tensor this rank's DTensor shard owns (``torch.chunk``
semantics, uneven and empty shards included) and reads exactly those bytes as one schedule
(``fsdp_fp8.reading.read_schedule``), through the staging ring when the storage is on an
accelerator. Scales are filled from the values ``open_checkpoint`` checked, never read again.

Reading is purely local; :func:`load_checkpoint` runs it in one ``collective_phase``, so a failure
on any rank raises on all and leaves the model unusable. The FP8 codes are checked for E4M3's NaN
patterns in the same pass, and every shard is checked to be the file that was validated.

Design: docs/design.md, "Data flow" and "The reader"; docs/reliability.md, "Guarantees".
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_fp8.collective import DEFAULT_TIMEOUT_S, collective_phase, outcome_timeout_s, rank_and_world
from fsdp_fp8.errors import CheckpointError, raise_if_problems
from fsdp_fp8.fp8.codes_check import CodeCheck, nan_code_problems
from fsdp_fp8.load.fsdp_wrap import local_rows, shard_position
from fsdp_fp8.load.meta_build import tensors_on_meta
from fsdp_fp8.load.progress import LoadProgress
from fsdp_fp8.reading import read_schedule, slice_reader
from fsdp_fp8.reading.read_options import DEFAULT_READ_OPTIONS, ReadOptions
from fsdp_fp8.reading.read_schedule import Piece
from fsdp_fp8.reading.staging import StagingRing, staging_ring

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
    seconds: float  # after the model is set up: the reads and the agreement on their outcome
    read_seconds: float  # the reads alone: what GB/s is measured over (waiting for peers is not I/O)
    peak_rss_bytes: int
    peak_device_bytes: int | None
    # host time in the FP8 NaN-code check, summed over the reader's workers that run it as reads
    # land (overlapping the other reads), plus the check of staged codes (on CUDA: launching it)
    code_check_seconds: float = 0.0
    prefetch_bytes: int = 0  # this rank's ranges hinted to the page cache while the model was set up
    reads: str = ""  # how the rows were read: O_DIRECT or the page cache, threads, request size, why
    read_options: ReadOptions | None = None  # the settings the reads ran with (resolved by the load)

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds > 0 else 0.0


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    assert t.is_contiguous(), "loader writes into contiguous storage only"
    return t.reshape(-1).view(torch.uint8)


def _pieces(entry, start: int, stop: int, dest: torch.Tensor, stage_cpu: bool = False) -> list[Piece]:
    """Rows [start, stop) of ``entry`` into ``dest`` (any dtype, contiguous) as schedule pieces:
    read in place into CPU storage, staged through the host ring anywhere else (or, with
    ``stage_cpu``, into CPU storage too: the tests' way to run the ring without a GPU)."""
    if stop <= start:
        return []
    offset, nbytes = slice_reader.row_range(entry, start, stop)
    dest_bytes = _byte_view(dest)
    if dest_bytes.numel() != nbytes:
        raise CheckpointError(
            f"`{entry.key}` in {entry.file}: rows [{start}, {stop}) are {nbytes} bytes but the model's "
            f"local storage holds {dest_bytes.numel()}",
            "rank read",
        )
    if dest_bytes.device.type == "cpu" and not stage_cpu:
        return [Piece(entry, offset, nbytes, slice_reader.writable(dest_bytes))]
    return [Piece(entry, offset, nbytes, dest_bytes, staged=True)]


def _read_pieces(
    pieces: list[Piece],
    device: torch.device,
    progress: LoadProgress,
    after_read=None,
    *,
    options: ReadOptions = DEFAULT_READ_OPTIONS,
    counted: list[int] | None = None,
) -> list[str]:
    """Every piece read (``read_schedule``), staged ones through one ring; the problems.
    ``after_read``: run by the reader's workers on bytes read in place (``read_schedule.run``);
    ``counted[0]`` grows by every byte read (this load's own count)."""
    staged = sum(p.nbytes for p in pieces if p.staged)
    slot, slots = staging_ring(staged, options.staging_bytes)
    ring = StagingRing(slot, slots, device) if staged else None
    request_bytes = options.request_bytes or read_schedule.REQUEST_BYTES
    requests = read_schedule.schedule(pieces, request_bytes=request_bytes, staged_bytes=slot)
    done = [0] if counted is None else counted

    def on_read(n: int) -> None:  # finished requests' bytes
        done[0] += n
        progress.update(done[0])

    try:
        problems = read_schedule.run(
            requests,
            stage=ring,
            threads=options.threads or read_schedule.THREADS,
            in_flight=options.in_flight,
            on_read=on_read,
            after_read=after_read,
            direct=bool(options.direct),
        )
    except BaseException:
        if ring is not None:  # no copy may still read from the ring once it is released...
            try:
                ring.drain()
            except Exception as exc:  # ...but the read's error is the one to raise
                log.error("draining the staging ring after a failed read: %s: %s", type(exc).__name__, exc)
        raise
    if ring is not None:
        ring.drain()
    return problems


def _named_tensor(model: nn.Module, name: str) -> torch.Tensor:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        return module._parameters[leaf]
    if leaf in module._buffers:
        return module._buffers[leaf]
    raise KeyError(f"`{name}` is neither a parameter nor a buffer of the model (was it changed after planning?)")


@dataclass
class _Targets:
    """What ``_targets`` found: the pieces to read, the codes to check on their device, the
    bytes the targets hold and the device they are on."""

    pieces: list[Piece]
    staged_codes: list[tuple]
    held: int
    device: torch.device


def _targets(model: nn.Module, plan, stage_cpu: bool) -> _Targets:
    """Every read of this rank as pieces; the scales (validated when the checkpoint was opened,
    never read twice) filled from memory on the way."""
    found = _Targets([], [], 0, torch.device("cpu"))
    scales = plan.checkpoint.scales
    for target in plan.fp8:
        weight = model.get_submodule(target.module).weight
        local, start, stop = local_rows(weight, f"{target.module}.weight")
        mine = _pieces(target.entry.weight, start, stop, local.qdata, stage_cpu)
        found.pieces += mine
        local.scale.fill_(scales[target.entry.weight_scale.key])
        local.act_quant_scale.fill_(scales[target.entry.input_scale.key])
        found.held += local.qdata.numel() + 8
        if any(p.staged for p in mine):  # checked on its device after the ring's copies
            found.staged_codes.append((target.entry.weight, local.qdata))
            found.device = _ring_device(found.device, local.qdata.device)
    for target in plan.tensors:
        local, start, stop = local_rows(_named_tensor(model, target.name), target.name)
        if target.entry.key in scales:  # a KV-cache scale: its validated value
            local.fill_(scales[target.entry.key])
        else:
            mine = _pieces(target.entry, start, stop, local, stage_cpu)
            found.pieces += mine
            if any(p.staged for p in mine):
                found.device = _ring_device(found.device, local.device)
        found.held += local.numel() * local.element_size()
    return found


def _ring_device(so_far: torch.device, staged_to: torch.device) -> torch.device:
    """The staging ring's device: the accelerator staged pieces go to (under CPU offload the
    parameters are on the host and only the buffers are staged: the ring must be pinned for
    their device, not follow whichever tensor came last)."""
    return staged_to if so_far.type == "cpu" else so_far


@dataclass(frozen=True)
class RowsRead:
    """What one rank's reads did (``read_rows``)."""

    bytes_held: int
    tensors: int
    bytes_read: int  # this load's bytes, counted by its own reads (never another load's)
    read_seconds: float
    code_check_seconds: float


def _load_local(
    model: nn.Module, plan, *, options: ReadOptions = DEFAULT_READ_OPTIONS, stage_cpu: bool = False
) -> RowsRead:
    """Every read this rank does, then the FP8 code check and the changed-file check; raises the
    problems once. ``stage_cpu`` stages CPU destinations too (tests)."""
    t_read = time.perf_counter()
    in_place = CodeCheck(t.entry.weight for t in plan.fp8)
    rank, _ = rank_and_world()
    shards, shard = shard_position(model)  # what this rank reads: its shard coordinate's rows (HSDP too)
    progress = LoadProgress(plan.load_bytes(shards, shard), enabled=rank == 0)
    counted = [0]
    with torch.no_grad():
        found = _targets(model, plan, stage_cpu)
        try:
            problems = _read_pieces(
                found.pieces, found.device, progress, after_read=in_place, options=options, counted=counted
            )
        finally:
            progress.close()  # a failed read ends the bar's line too
        t0 = time.perf_counter()
        if not problems:  # (bytes a failed read left unwritten are not the file's: nothing to check)
            problems += in_place.problems() + nan_code_problems(found.staged_codes)
        checked_s = in_place.seconds + time.perf_counter() - t0
    problems += plan.checkpoint.changed_files()
    raise_if_problems(problems, "what this rank read")
    return RowsRead(found.held, len(plan.fp8) + len(plan.tensors), counted[0], time.perf_counter() - t_read, checked_s)


def read_rows(model: nn.Module, plan, options: ReadOptions = DEFAULT_READ_OPTIONS) -> RowsRead:
    """This rank's rows of every tensor ``plan`` names, read into ``model``'s local storage
    (swapped, sharded and materialized: nothing may be on meta). Local: no collective; run it
    inside a ``collective_phase`` so a failure here reaches every rank."""
    on_meta = tensors_on_meta(model)
    if on_meta:
        raise RuntimeError(f"materialize the model before loading; still on meta: {on_meta[:5]}")
    rows = _load_local(model, plan, options=options)
    left = tensors_on_meta(model)
    assert not left, left
    return rows


def load_report(
    rows: RowsRead, plan, seconds: float, prefetched: int = 0, reads: str = "", options: ReadOptions | None = None
) -> LoadReport:
    """The ``LoadReport`` of a load whose reads did ``rows`` and that took ``seconds``."""
    rank, world = rank_and_world()
    device_peak = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # this process's own device
        device_peak = torch.cuda.max_memory_allocated(torch.cuda.current_device())
    return LoadReport(
        rank=rank,
        world_size=world,
        fp8_linears=len(plan.fp8),
        tensors=rows.tensors,
        bytes_read=rows.bytes_read,
        bytes_held=rows.bytes_held,
        seconds=seconds,
        read_seconds=rows.read_seconds,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        peak_device_bytes=device_peak,
        code_check_seconds=rows.code_check_seconds,
        prefetch_bytes=prefetched,
        reads=reads,
        read_options=options,
    )


def load_checkpoint(
    model: nn.Module, plan, *, timeout_s: float | None = None, options: ReadOptions = DEFAULT_READ_OPTIONS
) -> LoadReport:
    """Fill a swapped, sharded and materialized model following ``plan`` (from ``plan_load``),
    which names the checkpoint and every entry to read: ``read_rows`` in one
    ``collective_phase``.

    Collective when a process group is up (on the agreement's gloo side group). On any rank's
    failure every rank raises the same error and no module of the model computes again
    (``mark_unusable``). ``timeout_s``: how long a rank waits for the slowest peer's outcome;
    default ``outcome_timeout_s(plan.slowest_rank_bytes(shards), DEFAULT_TIMEOUT_S)``, sized from
    the read forecast over the model's shard-dim size (``fsdp_wrap.shard_position``).
    """
    if timeout_s is None:
        timeout_s = outcome_timeout_s(plan.slowest_rank_bytes(shard_position(model)[0]), DEFAULT_TIMEOUT_S)
    t0 = time.perf_counter()
    with collective_phase(model, "load", timeout_s, failed="checkpoint load failed"):
        rows = read_rows(model, plan, options)
    return load_report(rows, plan, time.perf_counter() - t0)
