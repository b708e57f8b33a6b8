"""The rank-slice loader: each rank reads only its own rows, straight into its local storage.

Reading is purely local (no collective per tensor): a rank works out which rows of each
tensor its DTensor shard owns (``torch.chunk`` semantics, uneven and empty shards
included), and reads exactly those bytes from the safetensors files into the shard's storage,
all of them as one schedule (``fsdp_fp8.format.read_schedule``: sorted by file and offset,
adjacent ranges coalesced into one ``preadv``, a small thread pool) and, when the storage is on
an accelerator, through one ring of host buffers allocated once (``fsdp_fp8.load.staging``);
the per-tensor scales are filled from memory. One small collective at the end makes every rank agree on the outcome,
so a failure on any rank raises on all of them and no rank keeps a half-loaded model.
If that collective itself fails (a peer died mid-load) or times out (a peer hangs; bounded
by the agreement timeout, ``fsdp_fp8.collective``), this rank marks the model unusable and
raises a ``PeerLostError`` saying so: the model is never left usable after a failed load.

What is read is checked in the same pass, on the rank that read it: the FP8 codes of every
weight for the two E4M3 NaN patterns (ModelOpt saturates to +-448 and never writes them), on
the device that holds them. Scales are not read again: the values ``open_checkpoint`` checked
are used. After the last read every shard is checked to be the file that was validated
(``Checkpoint.changed_files``).
"""

from __future__ import annotations

import logging
import resource
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fsdp_fp8.collective import DEFAULT_TIMEOUT_S, collective_phase, outcome_timeout_s, rank_and_world
from fsdp_fp8.errors import raise_if_problems
from fsdp_fp8.format import read_schedule, slice_reader
from fsdp_fp8.format.read_schedule import Piece
from fsdp_fp8.format.sharding import staging_ring
from fsdp_fp8.load.fsdp_wrap import shard_position
from fsdp_fp8.load.meta_build import tensors_on_meta
from fsdp_fp8.load.progress import LoadProgress
from fsdp_fp8.load.staging import StagingRing

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
    # host time in the FP8 NaN-code check, summed over the reader's workers that run it as reads
    # land (overlapping the other reads), plus the check of staged codes (on CUDA: launching it)
    code_check_seconds: float = 0.0
    prefetch_bytes: int = 0  # this rank's ranges hinted to the page cache during ``prepare``

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds > 0 else 0.0


def local_rows(param: torch.Tensor, name: str = "tensor") -> tuple[torch.Tensor, int, int]:
    """This rank's storage of ``param`` and the global row range ``[start, stop)`` it holds.

    Over a 2-D HSDP mesh the placements are ``(Replicate(), Shard(0))``: the rows are the
    chunk of this rank's shard coordinate, the same on every replica.
    """
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


def _pieces(entry, start: int, stop: int, dest: torch.Tensor, stage_cpu: bool = False) -> list[Piece]:
    """Rows [start, stop) of ``entry`` into ``dest`` (any dtype, contiguous) as schedule pieces:
    read in place into CPU storage, staged through the host ring anywhere else (or, with
    ``stage_cpu``, into CPU storage too: the tests' way to run the ring without a GPU)."""
    if stop <= start:
        return []
    offset, nbytes = slice_reader.row_range(entry, start, stop)
    dest_bytes = _byte_view(dest)
    if dest_bytes.numel() != nbytes:
        raise ValueError(
            f"`{entry.key}` in {entry.file}: rows [{start}, {stop}) are {nbytes} bytes but the model's "
            f"local storage holds {dest_bytes.numel()}"
        )
    if dest_bytes.device.type == "cpu" and not stage_cpu:
        return [Piece(entry, offset, nbytes, slice_reader.writable(dest_bytes))]
    return [Piece(entry, offset, nbytes, dest_bytes, staged=True)]


def _read_pieces(pieces: list[Piece], device: torch.device, progress: LoadProgress, after_read=None) -> list[str]:
    """Every piece read (``read_schedule``), staged ones through one ring; the problems.
    ``after_read``: run by the reader's workers on bytes read in place (``read_schedule.run``)."""
    staged = sum(p.nbytes for p in pieces if p.staged)
    slot, slots = staging_ring(staged, slice_reader.STAGING_BYTES)
    ring = StagingRing(slot, slots, device) if staged else None
    requests = read_schedule.schedule(pieces, staged_bytes=slot)
    done = [0]

    def on_read(n: int) -> None:  # finished requests' bytes (the global counter runs ahead of them)
        done[0] += n
        progress.update(done[0])

    try:
        problems = read_schedule.run(requests, stage=ring, on_read=on_read, after_read=after_read)
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


def nan_code_flag(codes: torch.Tensor) -> torch.Tensor:
    """0-d bool on ``codes``' device: does any E4M3 code have the NaN pattern S.1111.111?

    0x7F is the largest int8 and 0xFF the largest uint8, so two max-reductions over the bytes,
    with no temporary, find both patterns: a few percent of the read, on the same memory.
    """
    u8 = codes.reshape(-1).view(torch.uint8)
    if u8.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=codes.device)
    return (u8.amax() == 0xFF) | (u8.view(torch.int8).amax() == 0x7F)


def nan_code_count(codes: torch.Tensor) -> int:
    """How many E4M3 codes have a NaN pattern (0x7F / 0xFF); one flag check first, so the usual
    answer (none) costs the two max-reductions alone."""
    if not bool(nan_code_flag(codes)):
        return 0
    return int(((codes.reshape(-1).view(torch.uint8) & 0x7F) == 0x7F).sum())


def _nan_code_problem(entry, count: int) -> str:
    return (
        f"`{entry.key}` in {entry.file} holds {count} FP8 codes that are NaN in E4M3 (0x7F / 0xFF); "
        "ModelOpt saturates to +-448 and never writes them"
    )


class CodeCheck:
    """The FP8 NaN-code check of the bytes read into host storage, run by the reader's workers
    on each request as it lands (``read_schedule.run(after_read=...)``): it overlaps the other
    workers' reads instead of adding a pass over every weight after the last read."""

    def __init__(self, fp8_entries):
        self.entries = {e.key: e for e in fp8_entries}
        self.counts: dict[str, int] = {}
        self.seconds = 0.0  # summed over the workers
        self._lock = threading.Lock()

    def __call__(self, request, buffers) -> None:
        t0 = time.perf_counter()
        found = {}
        for piece, buf in zip(request.pieces, buffers):
            if piece.entry.key in self.entries:
                found[piece.entry.key] = found.get(piece.entry.key, 0) + nan_code_count(
                    torch.frombuffer(buf, dtype=torch.uint8)
                )
        with self._lock:
            for key, n in found.items():
                self.counts[key] = self.counts.get(key, 0) + n
            self.seconds += time.perf_counter() - t0

    def problems(self) -> list[str]:
        return [_nan_code_problem(self.entries[k], n) for k, n in sorted(self.counts.items()) if n]


def _nan_code_problems(checks: list[tuple]) -> list[str]:
    """The check of codes read through the staging ring, on the device that holds them after the
    ring's copies: (entry, codes) pairs, one sync for all of them."""
    if not checks or checks[0][1].is_meta:  # (meta: no bytes to check; tests stand in a meta model)
        return []
    flags = [nan_code_flag(codes) for _, codes in checks]
    if not bool(torch.stack(flags).any()):
        return []
    return [_nan_code_problem(entry, nan_code_count(codes)) for (entry, codes), flag in zip(checks, flags) if flag]


def _load_local(model: nn.Module, plan, *, stage_cpu: bool = False) -> tuple[int, int, float]:
    """Every read this rank does; returns (bytes held by the targets, number of tensors, seconds
    spent in the FP8 code check). ``stage_cpu`` stages CPU destinations too (tests)."""
    held, checked_s, pieces, staged_codes = 0, 0.0, [], []
    in_place = CodeCheck(t.entry.weight for t in plan.fp8)
    scales = plan.checkpoint.scales  # validated when the checkpoint was opened: never read twice
    rank = dist.get_rank() if dist.is_initialized() else 0
    shards, shard = shard_position(model)  # what this rank reads: its shard coordinate's rows (HSDP too)
    progress = LoadProgress(plan.load_bytes(shards, shard), enabled=rank == 0)
    device = torch.device("cpu")
    with torch.no_grad():
        for target in plan.fp8:
            weight = model.get_submodule(target.module).weight
            local, start, stop = local_rows(weight, f"{target.module}.weight")
            mine = _pieces(target.entry.weight, start, stop, local.qdata, stage_cpu)
            pieces += mine
            local.scale.fill_(scales[target.entry.weight_scale.key])
            local.act_quant_scale.fill_(scales[target.entry.input_scale.key])
            held += local.qdata.numel() + 8
            if any(p.staged for p in mine):  # checked on its device after the ring's copies
                staged_codes.append((target.entry.weight, local.qdata))
            device = local.qdata.device
        for target in plan.tensors:
            local, start, stop = local_rows(_named_tensor(model, target.name), target.name)
            if target.entry.key in scales:  # a KV-cache scale: its validated value
                local.fill_(scales[target.entry.key])
            else:
                pieces += _pieces(target.entry, start, stop, local, stage_cpu)
            held += local.numel() * local.element_size()
            device = local.device
        try:
            problems = _read_pieces(pieces, device, progress, after_read=in_place)
        finally:
            progress.close()  # a failed read ends the bar's line too
        t0 = time.perf_counter()
        if not problems:  # (bytes a failed read left unwritten are not the file's: nothing to check)
            problems += in_place.problems() + _nan_code_problems(staged_codes)
        checked_s += in_place.seconds + time.perf_counter() - t0
    problems += plan.checkpoint.changed_files()
    raise_if_problems(problems, "what this rank read")
    return held, len(plan.fp8) + len(plan.tensors), checked_s


def _prepare_while_prefetching(prepare, plan, shards: int, shard: int) -> int:
    """Run ``prepare`` while a background thread hints this rank's first
    ``read_schedule.prefetch_budget()`` bytes to the page cache; the bytes hinted. The rows are
    the ``torch.chunk`` rows of shard coordinate ``shard`` of ``shards`` (the model is not sharded
    yet); a hint for other rows would cost page cache, never a wrong byte."""
    budget = read_schedule.prefetch_budget()
    if budget <= 0:
        prepare()
        return 0
    prefetch = read_schedule.Prefetch(read_schedule.prefetch_ranges(plan.rank_ranges(shards, shard), budget))
    try:
        prepare()
    finally:
        hinted = prefetch.stop()
    return hinted


def load_checkpoint(
    model: nn.Module,
    plan,
    *,
    prepare=None,
    timeout_s: float | None = None,
    position: tuple[int, int] | None = None,
) -> LoadReport:
    """Fill a swapped, sharded and materialized model following ``plan`` (from ``plan_load``),
    which names the checkpoint and every entry to read.

    Collective when a process group is up (on the agreement's gloo side group). On any rank's
    failure every rank raises the same error and no module of the model computes again
    (``mark_unusable``). ``prepare``, if given, runs first inside that agreement (``load_model``
    passes the swap, ``fully_shard`` and ``to_empty``, so a rank failing there fails every rank
    too). ``timeout_s``: how long a rank waits for the slowest peer's outcome; default
    ``outcome_timeout_s(plan, shards, DEFAULT_TIMEOUT_S)``, sized from the read forecast over the
    shard-dim size (``fsdp_wrap.shard_size``). ``position``: (shard-dim size, this rank's shard
    coordinate) the model will have after ``prepare``, whose rows a prefetch hints
    (``read_schedule.PREFETCH_BYTES``) and whose forecast sizes the default timeout; default:
    what the model has now, (world size, rank) before ``prepare`` shards it (a 1-D mesh). An HSDP
    caller passing ``prepare`` passes it (``load_model`` does).
    """
    rank, world = rank_and_world()
    read_before = slice_reader.bytes_read()
    t0 = time.perf_counter()
    shards, shard = position or ((world, rank) if prepare is not None else shard_position(model))
    if timeout_s is None:
        timeout_s = outcome_timeout_s(plan, shards, DEFAULT_TIMEOUT_S)
    held, count, read_s, checked_s, prefetched = 0, 0, 0.0, 0.0, 0
    with collective_phase(model, "load", timeout_s, failed="checkpoint load failed"):
        if prepare is not None:
            prefetched = _prepare_while_prefetching(prepare, plan, shards, shard)
            read_before, t0 = slice_reader.bytes_read(), time.perf_counter()
        on_meta = tensors_on_meta(model)
        if on_meta:
            raise RuntimeError(f"materialize the model before loading; still on meta: {on_meta[:5]}")
        t_read = time.perf_counter()
        held, count, checked_s = _load_local(model, plan)
        read_s = time.perf_counter() - t_read
        left = tensors_on_meta(model)
        assert not left, left
    device_peak = (
        torch.cuda.max_memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    )
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
        code_check_seconds=checked_s,
        prefetch_bytes=prefetched,
    )
