"""fsdp_fp8 ``load_model`` against PyTorch's own Hugging Face reader, side by side, by phase.

    python -m bench.peer_load [--checkpoints mot,llama] [--worlds 1,2,4] [--cache cold,warm] [--reps 5]
    python -m bench.peer_load --checkpoints llama --worlds 2 --profile      # cProfile of rank 0, one cold trial

Methods (each trial: W fresh rank processes on gloo, page cache dropped before a cold trial,
the order of the methods rotating every repetition; wall time of the slowest rank between
two barriers; what a method imports is imported before its measured block):

  fsdp_fp8  ``fsdp_fp8.load_model(None, dir)``: each rank preads its own rows into its shards
  dcp-T     ``torch.distributed.checkpoint.load(model.state_dict(),
            storage_reader=HuggingFaceStorageReader(dir, thread_count=T))`` into a
            ``fully_shard``-ed model whose quantized linears hold plain ``float8_e4m3fn``
            weights and 0-d float32 ``weight_scale`` / ``input_scale`` buffers (the way a
            torchtitan user loads a ModelOpt checkpoint); T in 1, 2, 4 (DCP's reader threads
            share out files, not bytes: with fewer files than T the rest idle)
  bcast     rank 0 ``safetensors.torch.load_file`` of every file, then
            ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` into the
            same model (gloo cannot broadcast float8: its float8 parameters and the state dict
            are uint8 views of the same bytes)
  floor     the strict floor: each rank preads as many bytes as its rows hold, contiguous
            (rank r takes the r-th span of the files' concatenation), in 8 MiB requests, one
            thread, into a buffer touched before the timer; no model, no collective

What-ifs (not run by default): ``fsdp_fp8+noprefetch``, ``+buffered``, ``+direct``, ``+threads1``, ``+threads2``, ``+nocheck``
(no FP8 NaN-code check), combinable (``fsdp_fp8+noprefetch+nocheck``): the same load with one
tunable of the tree changed in the trial's processes, to see what each part costs; ``floor-T``
reads the floor's span in T contiguous parts on T threads.

Checkpoints: ``mot`` is this repo's generator (``bench/common.py``, ``--size``), ``llama`` a
Llama-shaped ModelOpt FP8 checkpoint written independently (``bench/peer_checkpoints.py``,
``--llama-size``); any other value is a checkpoint directory.

Per method and world size: the median of the slowest rank's seconds, each phase's median of the
slowest rank's seconds in it, the bytes asked per rank (what the method requested) and read from
storage (``/proc/self/io`` ``read_bytes``: page-cache misses, readahead included), and the peak
RSS growth per rank (file pages mapped by safetensors count: the process holds them). JSON lines
go to ``--results`` (default bench/results.jsonl).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from bench import common, harness

METHODS = ("fsdp_fp8", "dcp-1", "dcp-2", "dcp-4", "bcast", "floor")
REQUEST_BYTES = 8 << 20
# Imported by the fork server once, so that each trial's rank process starts with them loaded
# (and the measured block never pays for an import).
PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.hf_storage",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "safetensors.torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "fsdp_fp8.format.checkpoint",
    "fsdp_fp8.load.loaded",
    "fsdp_fp8.compose.model",
    "fsdp_fp8.interop.architectures",
    "fsdp_fp8.interop.hf_build",
    "fsdp_fp8.models",
]


# --- phases: how long each rank spends in each step (harness.Phases) ---------------------

# load_model's steps, by the function that runs each (module, name) -> phase. A name a newer
# tree no longer has is reported as not timed (``phases_missing``), never an error.
FSDP_FP8_STEPS = [  # (phase, candidates (module, name): the first one found is timed)
    ("side group", [("fsdp_fp8.collective.group", "side_group"), ("fsdp_fp8.load.agreement", "side_group")]),
    ("open", [("fsdp_fp8.format.checkpoint", "open_checkpoint")]),
    ("resolve architecture", [("fsdp_fp8.interop.architectures", "resolve_model_spec")]),
    ("plan", [("fsdp_fp8.load.plan", "plan_load")]),
    (
        "agreement (plan)",
        [("fsdp_fp8.collective.agreement", "agree_or_raise"), ("fsdp_fp8.load.agreement", "agree_or_raise")],
    ),
    ("start prefetch", [("fsdp_fp8.reading.prefetch", "start_prefetch")]),
    ("swap", [("fsdp_fp8.load.swap", "swap_fp8_linears")]),
    ("fully_shard", [("fsdp_fp8.load.fsdp_wrap", "shard_model")]),
    ("to_empty", [("fsdp_fp8.load.meta_build", "materialize")]),
    ("reads", [("fsdp_fp8.load.reader", "read_rows"), ("fsdp_fp8.load.reader", "_load_local")]),
    (
        "agreement (outcome)",
        [("fsdp_fp8.collective.phase", "agree_on_outcome"), ("fsdp_fp8.load.reader", "_agree")],
    ),
]


def instrument_fsdp_fp8(phases: harness.Phases) -> list[str]:
    """Time load_model's steps: every global of a loaded ``fsdp_fp8`` module bound to one of
    the step functions is rebound to a timed wrapper (the process is this trial's alone).
    The model built on meta is timed through the architecture's ``model_fn``. Returns the
    steps not found."""
    import importlib

    missing = []
    for phase, candidates in FSDP_FP8_STEPS:
        original = None
        for module_name, attr in candidates:
            try:
                original = getattr(importlib.import_module(module_name), attr)
                break
            except (ImportError, AttributeError):
                continue
        if original is None:
            missing.append(phase)
            continue
        wrapper = phases.wrap(phase, original)
        if attr == "resolve_model_spec":
            wrapper = _timed_architecture(phases, original)
        for name, module in list(sys.modules.items()):
            if name.startswith("fsdp_fp8") and module is not None:
                for key, value in list(vars(module).items()):
                    if value is original:
                        setattr(module, key, wrapper)
    return missing


def _timed_architecture(phases: harness.Phases, resolve):
    import dataclasses

    def timed(*args, **kwargs):
        with phases("resolve architecture"):
            arch = resolve(*args, **kwargs)
        return dataclasses.replace(arch, model_fn=phases.wrap("meta build", arch.model_fn))

    return timed


# What-if variants of fsdp_fp8 (``--methods fsdp_fp8+noprefetch+nocheck``): where the time goes,
# by taking one thing away. Each sets a tunable of the current tree in this trial's processes.
def _no_check(self, request, buffers) -> None:
    return None


EXPERIMENTS = {  # name -> ReadOptions fields, or a patch (owner, attribute, value)
    "noprefetch": {"prefetch_bytes": 0},
    "buffered": {"direct": False},  # the page cache, as before O_DIRECT (ReadOptions.direct)
    "direct": {"direct": True},
    "threads1": {"threads": 1},
    "threads2": {"threads": 2},
    "threads4": {"threads": 4},
    "threads8": {"threads": 8},
    "req4m": {"request_bytes": 4 << 20},
    "req16m": {"request_bytes": 16 << 20},
    "req32m": {"request_bytes": 32 << 20},
    "nocheck": ("fsdp_fp8.fp8.codes_check", "CodeCheck", "__call__", _no_check),  # the FP8 NaN-code check off
}


def apply_experiments(method: str) -> dict:
    """Patch this process for the what-ifs of ``method``; the ReadOptions fields it sets."""
    import importlib

    fields: dict = {}
    for name in method.split("+")[1:]:
        what = EXPERIMENTS[name]
        if isinstance(what, dict):
            fields.update(what)
            continue
        module_name, owner_name, attr, value = what
        owner = getattr(importlib.import_module(module_name), owner_name)
        if not hasattr(owner, attr):
            raise AttributeError(f"what-if {name!r}: {module_name}.{owner_name} has no {attr} in this tree")
        setattr(owner, attr, value)
    return fields


def _known(method: str) -> bool:
    if method.startswith("floor-"):
        return method[6:].isdigit()
    base, *extra = method.split("+")
    return base in METHODS and (not extra or base == "fsdp_fp8") and all(e in EXPERIMENTS for e in extra)


# --- the peer's model: the checkpoint's class with plain float8 parameters -----------------


def _headers(directory: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """key -> (safetensors dtype, shape), from every file's header."""
    from safetensors import safe_open

    out = {}
    for path in common.checkpoint_files(directory):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                s = f.get_slice(key)
                out[key] = (s.get_dtype(), tuple(s.get_shape()))
    return out


def plain_fp8_model(directory: Path, fp8_as_uint8: bool = False):
    """The class config.json names, built on meta in its dtype, every FP8 weight of the files a
    plain ``float8_e4m3fn`` parameter (``uint8`` with ``fp8_as_uint8``) and every 0-d scale a
    float32 buffer of its module: a state dict with the checkpoint's keys, dtypes and shapes."""
    import torch
    from torch import nn

    config = json.loads((directory / "config.json").read_text())
    if config.get("_class_name"):  # this repo's reference MoT
        from fsdp_fp8.models import MoTConfig, build_model

        with torch.device("meta"):
            model = build_model(MoTConfig.from_config_dict(config), device="meta")
    else:
        import transformers

        hf_config = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "quantization_config"})
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    fp8 = torch.uint8 if fp8_as_uint8 else torch.float8_e4m3fn
    for key, (dtype, shape) in _headers(directory).items():
        module_name, _, leaf = key.rpartition(".")
        module = model.get_submodule(module_name)
        if dtype == "F8_E4M3":
            module._parameters[leaf] = nn.Parameter(torch.empty(shape, dtype=fp8, device="meta"), requires_grad=False)
        elif not shape and leaf not in module._parameters and leaf not in module._buffers:
            module.register_buffer(leaf, torch.empty((), dtype=torch.float32, device="meta"))
    return model


def plain_fully_shard(model) -> None:
    """torchtitan's pattern with plain ``fully_shard``: each block of every ModuleList, then the root."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for block in module:
                if any(True for _ in block.parameters()):
                    fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _sharded_peer_model(directory: Path, phases: harness.Phases, fp8_as_uint8: bool = False):
    with phases("meta build"):
        model = plain_fp8_model(directory, fp8_as_uint8)
    with phases("fully_shard"):
        plain_fully_shard(model)
    with phases("to_empty"):
        model.to_empty(device="cpu")
    return model


# --- the methods: each runs inside the measured block of one rank process -----------------


def method_fsdp_fp8(directory: Path, phases: harness.Phases, opts: dict) -> dict:
    import torch

    from fsdp_fp8.compose.model import load_model
    from fsdp_fp8.reading import slice_reader

    slice_reader.reset_bytes_read()
    from fsdp_fp8.reading.read_options import ReadOptions

    options = ReadOptions(**opts.get("_read_fields", {}))
    loaded = load_model(None, directory, device=torch.device("cpu"), read_options=options)
    return {
        "bytes_asked": slice_reader.bytes_read(),
        "prefetch_bytes": loaded.report.prefetch_bytes,
        "code_check_thread_s": loaded.report.code_check_seconds,
        "reads": getattr(loaded.report, "reads", ""),
        "phases_missing": opts["_missing"],
        "_keep": loaded,
    }


def method_dcp(directory: Path, phases: harness.Phases, opts: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    asked, marks = [0], {}

    class TimedReader(HuggingFaceStorageReader):
        def read_metadata(self, *args, **kwargs):
            with phases("dcp read_metadata"):
                out = super().read_metadata(*args, **kwargs)
            marks["metadata read"] = time.perf_counter()
            return out

        def read_data(self, plan, planner):
            marks["planned"] = time.perf_counter()
            for item in plan.items:
                n = 1
                for length in item.lengths:
                    n *= length
                asked[0] += n * self.storage_data[item.storage_index].dtype.itemsize
            with phases("dcp read_data"):
                out = super().read_data(plan, planner)
            marks["read"] = time.perf_counter()
            return out

    model = _sharded_peer_model(directory, phases)
    with phases("state_dict"):
        state = model.state_dict()
    dcp.load(state, storage_reader=TimedReader(str(directory), thread_count=opts["threads"]))
    done = time.perf_counter()
    # Between the metadata and the reads: set-up, local plans, their gather, the global plan and
    # its scatter (a collective: it waits for the slowest rank); after the reads, the closing
    # all_gather (waits for the slowest rank's reads).
    phases.seconds["dcp plan"] = marks["planned"] - marks["metadata read"]
    phases.seconds["dcp close"] = done - marks["read"]
    return {"bytes_asked": asked[0], "_keep": model}


def method_bcast(directory: Path, phases: harness.Phases, opts: dict) -> dict:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model = _sharded_peer_model(directory, phases, fp8_as_uint8=True)
    state, read = {}, 0
    if dist.get_rank() == 0:
        with phases("load_file (rank 0)"):
            for path in common.checkpoint_files(directory):
                state.update(load_file(str(path)))
            state = {k: v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v for k, v in state.items()}
        read = sum(t.numel() * t.element_size() for t in state.values())
    with phases("set_model_state_dict"):
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del state
    return {"bytes_asked": read, "_keep": model}


def floor_span(files: list[tuple[str, int]], start: int, nbytes: int) -> list[tuple[str, int, int]]:
    """Bytes [start, start + nbytes) of the files' concatenation as (path, offset, length) pieces."""
    out, at = [], 0
    for path, size in files:
        lo, hi = max(start, at), min(start + nbytes, at + size)
        if hi > lo:
            out.append((path, lo - at, hi - lo))
        at += size
    return out


def _read_span(pieces, view, at: int) -> int:
    """Read ``pieces`` (path, offset, length) in order into ``view`` from ``at``; the end."""
    for path, offset, n in pieces:
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < n:
                step = min(REQUEST_BYTES, n - done)
                got = os.preadv(fd, [view[at + done : at + done + step]], offset + done)
                if got <= 0:
                    raise OSError(f"{path}: short read at {offset + done}")
                done += got
        finally:
            os.close(fd)
        at += n
    return at


def method_floor(directory: Path, phases: harness.Phases, opts: dict) -> dict:
    """The strict floor; ``floor-T`` (not a default method) splits the span into T contiguous
    parts read by T threads, to see whether one synchronous stream is the disk's limit."""
    buffer, pieces, threads = opts["_buffer"], opts["_pieces"], opts.get("threads", 1)
    view = memoryview(buffer.numpy())
    with phases("read"):
        if threads <= 1:
            at = _read_span(pieces, view, 0)
        else:
            from concurrent.futures import ThreadPoolExecutor

            total = sum(n for _, _, n in pieces)
            files = [(p, o, n) for p, o, n in pieces]
            cuts = [total * i // threads for i in range(threads + 1)]
            parts = [(_sub_span(files, cuts[i], cuts[i + 1] - cuts[i]), cuts[i]) for i in range(threads)]
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda part: _read_span(part[0], view, part[1]), parts))
            at = total
    return {"bytes_asked": at, "_keep": buffer}


def _sub_span(pieces, start: int, nbytes: int) -> list[tuple[str, int, int]]:
    """Bytes [start, start + nbytes) of a list of (path, offset, length) pieces."""
    out, at = [], 0
    for path, offset, n in pieces:
        lo, hi = max(start, at), min(start + nbytes, at + n)
        if hi > lo:
            out.append((path, offset + lo - at, hi - lo))
        at += n
    return out


def rank_row_bytes(directory: Path, world: int) -> list[int]:
    """What each rank's rows of every tensor with a shape hold, in bytes (torch.chunk rows)."""
    from fsdp_fp8.format.safetensors_header import read_header
    from fsdp_fp8.reading.rank_bytes import entry_rank_bytes

    entries = []
    for path in common.checkpoint_files(directory):
        problems: list[str] = []
        header = read_header(path, problems)
        if header is None or problems:
            raise ValueError(f"{path}: {problems}")
        entries += [e for e in header.tensors.values() if e.shape]
    return [sum(entry_rank_bytes(e, world, r) for e in entries) for r in range(world)]


# --- one trial: one process per rank -----------------------------------------------------


def _io_read_bytes() -> int:
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration):
        return -1


def _rank_child(method: str, rank: int, world: int, store: str, directory: str, opts: dict, conn) -> None:
    harness.run_rank_child(rank, conn, lambda: _rank_trial(method, rank, world, store, directory, opts))


def _rank_trial(method: str, rank: int, world: int, store: str, directory: str, opts: dict) -> dict:
    for name in PRELOAD:  # (already loaded by the fork server: a no-op then)
        __import__(name)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    directory = Path(directory)
    phases = harness.Phases()
    fn = {"fsdp_fp8": method_fsdp_fp8, "bcast": method_bcast}.get(method.split("+")[0], method_dcp)
    if method.startswith("floor"):
        fn = method_floor
    if method.startswith(("dcp-", "floor-")):
        opts = {**opts, "threads": int(method.split("-")[1])}
    if method.startswith("floor"):  # the pre-touched buffer and the span, outside the block
        n = opts["row_bytes"][rank]
        files = [(str(p), p.stat().st_size) for p in common.checkpoint_files(directory)]
        opts = {
            **opts,
            "_buffer": torch.ones(n, dtype=torch.uint8),
            "_pieces": floor_span(files, sum(opts["row_bytes"][:rank]), n),
        }
    if method.startswith("fsdp_fp8"):  # the what-ifs and the timed wrappers, outside the block
        opts = {**opts, "_read_fields": apply_experiments(method), "_missing": instrument_fsdp_fp8(phases)}
    profiler = None
    if opts.get("profile") and rank == 0:
        import cProfile

        profiler = cProfile.Profile()
    dist.barrier()
    io0 = _io_read_bytes()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    with common.PeakRSS() as mem:
        if profiler:
            profiler.enable()
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(directory, phases, opts)
        dist.barrier()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        if profiler:
            profiler.disable()
    disk = _io_read_bytes() - io0 if io0 >= 0 else -1
    out.pop("_keep")
    result = {
        "rank": rank,
        "seconds": seconds,
        "rss_growth": mem.growth,
        "disk_read_bytes": disk,
        "phases": dict(phases.seconds),
        "phases_cpu": dict(phases.cpu),
        "cpu_s": cpu,
        "cpu_user_s": ru1.ru_utime - ru0.ru_utime,  # (every thread of the rank's process)
        "cpu_sys_s": ru1.ru_stime - ru0.ru_stime,
        "minor_faults": ru1.ru_minflt - ru0.ru_minflt,
        **out,
    }
    if profiler:
        path = Path(opts["profile"]) / f"{opts['label']}-{method}-w{world}.pstats"
        profiler.dump_stats(str(path))
        result["profile"] = str(path)
    return result


def warm_page_cache(directory: Path) -> None:
    buf = bytearray(REQUEST_BYTES)
    for path in common.checkpoint_files(directory):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def run_trial(ctx, method: str, world: int, directory: Path, cache: str, opts: dict, timeout: float) -> list[dict]:
    if cache == "cold":
        cold = common.drop_page_cache([directory])
    elif cache == "warm":
        cold = warm_page_cache(directory)
    else:  # "evicted": the caller evicted the files' pages just before (bench/load_floor.py)
        cold = True
    store = harness.file_store("fsdp_fp8-peer-")
    children = [(rank, _rank_child, (method, rank, world, store, str(directory), opts)) for rank in range(world)]
    results = harness.run_children(ctx, children, timeout)
    for r in results:
        r["cold"] = bool(cold) if cache != "warm" else False
    return results


# --- summary -----------------------------------------------------------------------------


def summarize(runs: list[list[dict]]) -> dict:
    ok = [r for r in runs if all("error" not in x for x in r)]
    if not ok:
        return {"error": next(x["error"] for r in runs for x in r if "error" in x)}
    world = len(ok[0])
    names: list[str] = []
    for r in ok:
        for x in r:
            names += [n for n in x["phases"] if n not in names]
    return {
        "runs": len(ok),
        "seconds_median": statistics.median(max(x["seconds"] for x in r) for r in ok),
        "seconds_all": [round(max(x["seconds"] for x in r), 3) for r in ok],
        # each phase: the slowest rank's seconds in it, median over the trials
        "phases_median": {n: statistics.median(max(x["phases"].get(n, 0.0) for x in r) for r in ok) for n in names},
        "phases_cpu_median": {
            n: statistics.median(max(x.get("phases_cpu", {}).get(n, 0.0) for x in r) for r in ok) for n in names
        },
        # process CPU seconds over the block (every thread), the busiest rank: what a method costs
        # the cores, which a loaded machine inflates less than wall time
        "cpu_s_median": statistics.median(max(x["cpu_s"] for x in r) for r in ok),
        "bytes_asked_per_rank": [ok[0][i]["bytes_asked"] for i in range(world)],
        "disk_read_per_rank": [statistics.median(r[i]["disk_read_bytes"] for r in ok) for i in range(world)],
        "rss_growth_per_rank": [max(r[i]["rss_growth"] for r in ok) for i in range(world)],
        "cold_cache": all(x["cold"] for r in ok for x in r),
        "prefetch_bytes_per_rank": [ok[0][i].get("prefetch_bytes") for i in range(world)],
        # the FP8 NaN-code check, summed over the reader's workers (they run it as reads land)
        "code_check_thread_s_median": statistics.median(max(x.get("code_check_thread_s", 0.0) for x in r) for r in ok),
        "phases_missing": ok[0][0].get("phases_missing", []),
    }


def format_table(rows: list[dict]) -> str:
    lines = []
    for (ckpt, world, cache), group in _groups(rows).items():
        rows_ok = [r for r in group if "error" not in r]
        base = next((r for r in rows_ok if r["method"] == "fsdp_fp8"), None)
        head = group[0]
        lines.append(
            f"\n{ckpt}: {common.mib(head['checkpoint_bytes'])} MiB in {head['files']} files, world size {world}, "
            f"{cache} cache, load average {head['load_average']}"
        )
        lines.append(
            f"{'method':<10} {'median s':>9} {'fsdp/this':>9} {'CPU s':>6} {'asked/rank MiB':>18} {'from disk/rank MiB':>20} "
            f"{'peak RSS growth/rank MiB':>26}  runs s"
        )
        for r in group:
            if "error" in r:
                lines.append(f"{r['method']:<10} FAILED: {r['error'].strip().splitlines()[-1]}")
                continue
            ratio = base["seconds_median"] / r["seconds_median"] if base else float("nan")
            lines.append(
                f"{r['method']:<10} {r['seconds_median']:>9.3f} {ratio:>9.2f} {r['cpu_s_median']:>6.2f} "
                f"{'/'.join(common.mib(b) for b in r['bytes_asked_per_rank']):>18} "
                f"{'/'.join(common.mib(b) for b in r['disk_read_per_rank']):>20} "
                f"{'/'.join(common.mib(b) for b in r['rss_growth_per_rank']):>26}  {r['seconds_all']}"
            )
        t = targets(group)
        if t:
            lines.append(
                "targets: "
                + (
                    f"load_model / best DCP ({t['best_dcp']}) = {t['vs_best_dcp']:.2f} (<= 0.8); "
                    if "best_dcp" in t
                    else ""
                )
                + (f"load_model / floor = {t['vs_floor']:.2f} (<= 1.3 at W=2); " if "vs_floor" in t else "")
                + f"peak RSS growth - rows = {t['rss_over_rows_mib']:.1f} MiB (<= 64)"
            )
        for r in rows_ok:
            lines.append(
                f"  {r['method']} phases (slowest rank, median s): "
                + ", ".join(f"{n} {s:.3f}" for n, s in ordered(r["phases_median"]))
                + (f" [not timed: {', '.join(r['phases_missing'])}]" if r["phases_missing"] else "")
            )
            if any(b is not None for b in r["prefetch_bytes_per_rank"]):
                lines.append(
                    f"  {r['method']} prefetch hinted (first trial) "
                    + "/".join(common.mib(b or 0) for b in r["prefetch_bytes_per_rank"])
                    + " MiB of the rows' "
                    + "/".join(common.mib(b) for b in r["row_bytes_per_rank"])
                    + f" MiB per rank; FP8 NaN-code check {r['code_check_thread_s_median']:.3f} thread-s (slowest rank)"
                )
    return "\n".join(lines)


PHASE_ORDER = [
    "side group",
    "open",
    "resolve architecture",
    "meta build",
    "plan",
    "agreement (plan)",
    "start prefetch",
    "swap",
    "fully_shard",
    "to_empty",
    "state_dict",
    "dcp read_metadata",
    "dcp plan",
    "dcp read_data",
    "dcp close",
    "load_file (rank 0)",
    "set_model_state_dict",
    "reads",
    "agreement (outcome)",
    "read",
]


def ordered(phases: dict[str, float]) -> list[tuple[str, float]]:
    """In the order the steps run (a results file's JSON keys come back sorted)."""
    rank = {n: i for i, n in enumerate(PHASE_ORDER)}
    return sorted(phases.items(), key=lambda kv: rank.get(kv[0], len(rank)))


def markdown(rows: list[dict]) -> str:
    """The same results as Markdown tables (what docs/benchmarks.md holds)."""
    lines = []
    for (ckpt, world, cache), group in _groups(rows).items():
        ok = [r for r in group if "error" not in r]
        base = next((r for r in ok if r["method"] == "fsdp_fp8"), None)
        head = group[0]
        lines += [
            "",
            f"**{ckpt}** ({common.mib(head['checkpoint_bytes'])} MiB, {head['files']} files), world size {world}, "
            f"{cache} cache (evicted: {all(r.get('cold_cache') for r in ok)}), {head['reps']} trials, "
            f"load average {head['load_average']}",
            "",
            "| method | median s | load_model / this | CPU s | asked / rank MiB | from disk / rank MiB "
            "| peak RSS growth / rank MiB | phases, slowest rank, median s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in group:
            if "error" in r:
                lines.append(f"| {r['method']} | failed: {r['error'].strip().splitlines()[-1]} | | | | | | |")
                continue
            ratio = r["seconds_median"] / base["seconds_median"] if base else float("nan")
            phases = ", ".join(f"{n} {v:.3f}" for n, v in ordered(r["phases_median"]) if v >= 0.0005)
            lines.append(
                f"| {r['method']} | {r['seconds_median']:.3f} | {1 / ratio:.2f} | {r.get('cpu_s_median', 0):.2f} | "
                f"{'/'.join(common.mib(b) for b in r['bytes_asked_per_rank'])} | "
                f"{'/'.join(common.mib(b) for b in r['disk_read_per_rank'])} | "
                f"{'/'.join(common.mib(b) for b in r['rss_growth_per_rank'])} | {phases} |"
            )
    return "\n".join(lines)


def targets(group: list[dict]) -> dict | None:
    """The issue's targets for one (checkpoint, world size, cache) group; None without fsdp_fp8."""
    ok = {r["method"]: r for r in group if "error" not in r}
    base = ok.get("fsdp_fp8")
    if base is None:
        return None
    out: dict = {}
    dcps = {m: r["seconds_median"] for m, r in ok.items() if m.startswith("dcp-")}
    if dcps:
        best = min(dcps, key=dcps.get)
        out["best_dcp"] = best
        out["vs_best_dcp"] = base["seconds_median"] / dcps[best]  # target <= 0.8
    if "floor" in ok:
        out["vs_floor"] = base["seconds_median"] / ok["floor"]["seconds_median"]  # target <= 1.3 (1.1)
    out["rss_over_rows_mib"] = max(
        (g - b) / 2**20 for g, b in zip(base["rss_growth_per_rank"], base["row_bytes_per_rank"])
    )  # target <= 64
    return out


def targets_markdown(rows: list[dict]) -> str:
    lines = [
        "| checkpoint | world size | cache | load_model / best DCP (target <= 0.8) | load_model / floor "
        "(target <= 1.3 at W=2) | peak RSS growth - rows, MiB (target <= 64) |",
        "|---|---|---|---|---|---|",
    ]
    for (ckpt, world, cache), group in _groups(rows).items():
        t = targets(group)
        if t is None:
            continue
        dcp = f"{t['vs_best_dcp']:.2f} ({t['best_dcp']})" if "vs_best_dcp" in t else "-"
        floor = f"{t['vs_floor']:.2f}" if "vs_floor" in t else "-"
        lines.append(f"| {ckpt} | {world} | {cache} | {dcp} | {floor} | {t['rss_over_rows_mib']:.1f} |")
    return "\n".join(lines)


def _groups(rows):
    out: dict = {}
    for r in rows:
        out.setdefault((r["checkpoint"], r["world_size"], r["cache"]), []).append(r)
    return out


# --- driver ------------------------------------------------------------------------------


def profile_summary(path: str, top: int) -> str:
    import pstats

    stats = pstats.Stats(path)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)
    out = [f"  total {sum(v[2] for _, v in rows):.3f} s own time, {sum(v[1] for _, v in rows):,} calls"]
    for (file, line, fn), (_, nc, tt, ct, _) in rows[:top]:
        where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if file != "~" else "(C)"
        out.append(f"  {tt:7.3f} s own {ct:7.3f} s cum {nc:>8,} calls  {fn}  {where}")
    return "\n".join(out)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", default="mot,llama", help="mot, llama, or checkpoint directories")
    p.add_argument("--size", choices=sorted(common.SIZES), default="default", help="the mot checkpoint's size")
    p.add_argument("--llama-size", default="llama-0.7g", help="bench/peer_checkpoints.py SHAPES")
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--cache", default="cold,warm")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", help="checkpoint cache (default $FSDP_FP8_BENCH_DIR or $TMPDIR/fsdp_fp8_bench)")
    p.add_argument("--results", default=str(common.RESULTS))
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--markdown", action="store_true", help="also print the results as Markdown tables")
    p.add_argument("--report", metavar="JSONL", help="run nothing: print the Markdown tables of a results file's runs")
    p.add_argument(
        "--profile",
        metavar="DIR",
        nargs="?",
        const="",
        default=None,
        help="cProfile rank 0 of one cold trial per method (pstats files into DIR, default a temp dir)",
    )
    return p.parse_args(argv)


def resolve_checkpoint(name: str, args) -> Path:
    if name == "mot":
        return Path(common.checkpoints(args.size, args.dir)[0])
    if name == "llama":
        from bench import peer_checkpoints

        return peer_checkpoints.llama_checkpoint(args.llama_size, args.dir)
    return Path(name)


def report(path: str) -> str:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("bench") == "peer_load"]
    return targets_markdown(rows) + "\n" + markdown(rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        print(report(args.report))
        return 0
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if not _known(m)]
    if unknown:
        raise SystemExit(
            f"unknown methods {unknown}; known: {', '.join(METHODS)}, and fsdp_fp8+WHAT-IF with WHAT-IF in "
            f"{', '.join(EXPERIMENTS)}"
        )
    worlds = [int(w) for w in args.worlds.split(",")]
    caches = [c for c in args.cache.split(",") if c]
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    opts: dict = {}
    if args.profile is not None:
        opts["profile"] = args.profile or tempfile.mkdtemp(prefix="fsdp_fp8-peer-profile-")
        Path(opts["profile"]).mkdir(parents=True, exist_ok=True)
        caches, args.reps = ["cold"], 1
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    rows: list[dict] = []
    for name in [c for c in args.checkpoints.split(",") if c]:
        directory = resolve_checkpoint(name, args)
        files = common.checkpoint_files(directory)
        ckpt_bytes = sum(f.stat().st_size for f in files)
        for world in worlds:
            row_bytes = rank_row_bytes(directory, world)
            for cache in caches:
                load_before = harness.load_average()
                trials: dict[str, list] = {m: [] for m in methods}
                for rep, m in harness.interleaved(methods, args.reps):
                    trial_opts = {**opts, "row_bytes": row_bytes, "label": Path(name).name}
                    r = run_trial(ctx, m, world, directory, cache, trial_opts, args.timeout)
                    trials[m].append(r)
                    status = next((x["error"].strip().splitlines()[-1] for x in r if "error" in x), None)
                    print(
                        f"{name} w{world} {cache} rep {rep} {m}: "
                        + (f"error: {status}" if status else f"{max(x['seconds'] for x in r):.3f} s"),
                        flush=True,
                    )
                load = f"{load_before} -> {harness.load_average()}"
                group = len(rows)
                for m in methods:
                    rows.append(
                        {
                            "bench": "peer_load",
                            "time": stamp,
                            "checkpoint": name,
                            "directory": str(directory),
                            "checkpoint_bytes": ckpt_bytes,
                            "files": len(files),
                            "world_size": world,
                            "cache": cache,
                            "method": m,
                            "row_bytes_per_rank": row_bytes,
                            "load_average": load,
                            "cpus": os.cpu_count(),
                            "reps": args.reps,
                            **summarize(trials[m]),
                        }
                    )
                    if opts.get("profile"):
                        rows[-1]["profile"] = next(
                            (x.get("profile") for r in trials[m] for x in r if x.get("profile")), None
                        )
                common.append_jsonl(args.results, rows[group:])  # group by group: a long run keeps what it has
                print(format_table(rows[group:]), flush=True)
    print("\nall groups:" + format_table(rows), flush=True)
    if args.markdown:
        print(targets_markdown(rows) + "\n" + markdown(rows), flush=True)
    for r in rows:
        if "error" in r:
            print(f"{r['checkpoint']} w{r['world_size']} {r['cache']} {r['method']}:\n{r['error']}", file=sys.stderr)
        if r.get("profile"):
            print(f"\ncProfile of {r['method']}, rank 0, main thread ({r['profile']}), by own time:")
            print(profile_summary(r["profile"], 15))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
