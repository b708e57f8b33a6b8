"""Load time, memory and bytes read: fsdp_fp8 against the standard FSDP2 path, prior-art FP8
loading, and the read-only floor, in one run, interleaved.

    torchrun --nproc-per-node 4 -m bench.load [--size small|default] [--reps 3] [--dir DIR]
    python -m bench.load --setup      # FP8-vs-BF16 set-up cost at Super scale (bench/setup_cost.py)

Methods (each in a fresh process per rank, so peak RSS is this method's alone):
  a  fsdp_fp8 ``load_model`` from the FP8 checkpoint (each rank preads its own rows)
  b  standard FSDP2: meta build, fully_shard, to_empty, BF16 checkpoint read on rank 0,
     ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``
  c  prior-art FP8: every rank reads each full FP8 tensor (safetensors) and
     ``distribute_tensor``s it (as uint8: gloo refuses float8) into the same sharded model
  d  floor: the same ranks pread only the bytes they need into preallocated buffers
  p  a without prefetch (``ReadOptions(prefetch_bytes=0)``); a hints the rank's ranges to
     the page cache (POSIX_FADV_WILLNEED) while the model is set up, by default

CUDA variant (``--device cuda``: NCCL, one GPU per rank; skipped with its reason without CUDA):
  a  ``load_model(device=cuda)``: the reader's pinned staging ring, copies on a side stream
  n  NCCL broadcast from one reader: rank 0 reads each full tensor, every rank receives it
     on its GPU and keeps its rows (also runs on CPU over gloo: ``--methods n``)
  c  full read + scatter (as above, each full tensor moved to the GPU first)
  d  the storage floor (host preads, as above); h  pinned host-to-device copy of the rank's bytes
The target with a GPU: a's GB/s per rank >= 80% of min(d, h), measured in the same run.

Before every trial the checkpoint files are evicted from the page cache
(POSIX_FADV_DONTNEED); ``--warm`` skips that. Results go to a table on stdout and JSON
lines in ``--results`` (default bench/results.jsonl).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

from bench import common, harness
from fsdp_fp8.load.plan import plan_load
from fsdp_fp8.runtime.shutdown import shutdown_distributed

METHODS = ("a", "b", "c", "d", "p", "n", "h")
CUDA_METHODS = "ancdh"
DEVICE = "cpu"  # set in each trial's process from --device
NAMES = {
    "a": "fsdp_fp8",
    "b": "FSDP2 BF16 bcast",
    "c": "full FP8 + distribute",
    "d": "floor (pread)",
    "p": "fsdp_fp8, no prefetch",
    "n": "bcast from 1 reader",
    "h": "pinned H2D",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(common.SIZES), default="default")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--methods", default=None, help="default: abcd (cpu), ancdh (cuda)")
    p.add_argument("--dir", help="checkpoint cache (default $FSDP_FP8_BENCH_DIR or $TMPDIR/fsdp_fp8_bench)")
    p.add_argument("--warm", action="store_true", help="do not evict the checkpoints from the page cache")
    p.add_argument("--results", default=str(common.RESULTS))
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help=f"cuda: NCCL, one GPU per rank, methods {CUDA_METHODS} by default (skipped without CUDA)",
    )
    p.add_argument(
        "--setup",
        action="store_true",
        help="only the FP8-vs-BF16 set-up comparison at Super scale (bench/setup_cost.py; no torchrun)",
    )
    return p.parse_args(argv)


# --- the four methods: run in a fresh child process, inside the timed, measured block ----


def _local_bytes(model) -> int:
    """Bytes of every distinct storage this rank's model holds (FP8 codes, scales, shards)."""
    from fsdp_fp8.load.meta_build import storage_tensors

    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        for x in storage_tensors(t):
            s = x.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
    return total


def method_p(fp8_dir, bf16_dir, cfg) -> dict:
    from fsdp_fp8.reading.read_options import ReadOptions

    return method_a(fp8_dir, bf16_dir, cfg, ReadOptions(prefetch_bytes=0))  # a's default hints every row


def method_a(fp8_dir, bf16_dir, cfg, options=None) -> dict:
    from fsdp_fp8.compose.model import load_model
    from fsdp_fp8.interop.architectures import resolve_model_spec
    from fsdp_fp8.reading import slice_reader
    from fsdp_fp8.reading.read_options import ReadOptions

    slice_reader.reset_bytes_read()
    arch = resolve_model_spec(cfg.to_config_dict())
    loaded = load_model(arch.model_fn, fp8_dir, device=_device(), read_options=options or ReadOptions())
    return {
        "bytes_read": slice_reader.bytes_read(),
        "held": _local_bytes(loaded.model),
        "read_phase_s": loaded.report.seconds,
        "code_check_s": loaded.report.code_check_seconds,
        "prefetch_bytes": loaded.report.prefetch_bytes,
        "_keep": loaded,
    }


def method_b(fp8_dir, bf16_dir, cfg) -> dict:
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from fsdp_fp8.load.fsdp_wrap import default_mesh, shard_model
    from fsdp_fp8.models import build_model

    model = build_model(cfg, device="meta")
    shard_model(model, default_mesh("cpu"))
    model.to_empty(device="cpu")
    sd, read = {}, 0
    if dist.get_rank() == 0:
        for path in common.checkpoint_files(Path(bf16_dir)):
            sd.update(load_file(path))
        read = sum(t.numel() * t.element_size() for t in sd.values())
    set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del sd
    return {"bytes_read": read, "held": _local_bytes(model), "_keep": model}


def _device():
    import torch

    if DEVICE == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _open_and_shard(fp8_dir):
    import torch  # noqa: F401

    from fsdp_fp8.format.checkpoint import open_checkpoint
    from fsdp_fp8.interop.architectures import resolve_model_spec
    from fsdp_fp8.load.fsdp_wrap import default_mesh, shard_model
    from fsdp_fp8.load.meta_build import materialize, meta_init
    from fsdp_fp8.load.swap import swap_fp8_linears

    checkpoint = open_checkpoint(fp8_dir)
    with meta_init():
        model = resolve_model_spec(checkpoint.config).model_fn(checkpoint.config)
    plan = plan_load(checkpoint, model)
    swap_fp8_linears(model, plan)
    shard_model(model, default_mesh(_device().type))
    materialize(model, _device())
    return model, plan


def method_c(fp8_dir, bf16_dir, cfg) -> dict:
    """Prior art: full tensors on every rank, then ``distribute_tensor`` (rank 0's copy is scattered)."""
    import torch
    from safetensors import safe_open
    from torch.distributed.tensor import Shard, distribute_tensor

    from fsdp_fp8.load.reader import _named_tensor

    model, plan = _open_and_shard(fp8_dir)
    jobs = {}  # file -> [(key, dest param, what)]
    for t in plan.fp8:
        weight = model.get_submodule(t.module).weight
        jobs.setdefault(t.entry.weight.path, []).append((t.entry.weight.key, weight, "codes"))
        jobs.setdefault(t.entry.weight_scale.path, []).append((t.entry.weight_scale.key, weight, "scale"))
        jobs.setdefault(t.entry.input_scale.path, []).append((t.entry.input_scale.key, weight, "input_scale"))
    for t in plan.tensors:
        jobs.setdefault(t.entry.path, []).append((t.entry.key, _named_tensor(model, t.name), "tensor"))
    read = 0
    with torch.no_grad():
        for path, items in sorted(jobs.items()):
            with safe_open(path, framework="pt") as f:
                for key, param, what in items:
                    full = f.get_tensor(key)
                    read += full.numel() * full.element_size()
                    full = full.to(_device())
                    local = param._local_tensor
                    if what == "scale":
                        local.scale.copy_(full.reshape(1, 1))
                        continue
                    if what == "input_scale":
                        local.act_quant_scale.copy_(full.reshape(1, 1))
                        continue
                    dest = local.qdata if what == "codes" else local
                    rows = full.shape[0] if full.ndim else 1
                    as_bytes = full.reshape(rows, -1).view(torch.uint8)  # rows of bytes: same chunks
                    shard = distribute_tensor(as_bytes, param.device_mesh, [Shard(0)])
                    dest.reshape(dest.shape[0] if dest.ndim else 1, -1).view(torch.uint8).copy_(shard._local_tensor)
                    del full, as_bytes, shard
    return {"bytes_read": read, "held": _local_bytes(model), "_keep": model}


def method_n(fp8_dir, bf16_dir, cfg) -> dict:
    """One reader, broadcast: rank 0 reads each full tensor (file order), moves it to the device,
    ``dist.broadcast``s it; every rank copies its own rows into its shard. Scales from memory."""
    import torch
    import torch.distributed as dist

    from fsdp_fp8.load.reader import _named_tensor, local_rows
    from fsdp_fp8.reading import slice_reader

    model, plan = _open_and_shard(fp8_dir)
    device, rank, read = _device(), dist.get_rank(), 0
    scales = plan.checkpoint.scales
    jobs = []  # (entry, this rank's destination, its first global row)
    with torch.no_grad():
        for t in plan.fp8:
            local, start, _ = local_rows(model.get_submodule(t.module).weight)
            local.scale.fill_(scales[t.entry.weight_scale.key])
            local.act_quant_scale.fill_(scales[t.entry.input_scale.key])
            jobs.append((t.entry.weight, local.qdata, start))
        for t in plan.tensors:
            local, start, _ = local_rows(_named_tensor(model, t.name))
            if t.entry.key in scales:
                local.fill_(scales[t.entry.key])
            else:
                jobs.append((t.entry, local, start))
        for entry, dest, start in sorted(jobs, key=lambda j: (j[0].file, j[0].begin)):
            rows = entry.shape[0] if entry.shape else 1
            full = torch.empty(entry.nbytes, dtype=torch.uint8, device=device)
            if rank == 0:
                full.copy_(slice_reader.read_bytes(entry, 0, rows).reshape(-1).view(torch.uint8))
                read += entry.nbytes
            dist.broadcast(full, src=0)
            row = entry.nbytes // rows if rows else 0
            mine = dest.reshape(-1).view(torch.uint8)
            mine.copy_(full[start * row : start * row + mine.numel()])
            del full
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"bytes_read": read, "held": _local_bytes(model), "_keep": model}


def method_h(fp8_dir, bf16_dir, cfg) -> dict:
    """Pinned host -> device copy of as many bytes as this rank loads (no file, no model)."""
    import torch
    import torch.distributed as dist

    from fsdp_fp8.format.checkpoint import open_checkpoint
    from fsdp_fp8.reading.rank_bytes import entry_rank_bytes

    if DEVICE != "cuda":
        raise RuntimeError("method h measures pinned host-to-device copies: --device cuda only")
    ckpt = open_checkpoint(fp8_dir)
    n = sum(entry_rank_bytes(e, dist.get_world_size(), dist.get_rank()) for e in ckpt.tensors.values() if e.shape)
    host = torch.ones(n, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device=_device())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return {"bytes_read": 0, "held": n, "h2d_s": time.perf_counter() - t0, "_keep": dev}


def method_d(fp8_dir, bf16_dir, cfg) -> dict:
    """The floor: read this rank's rows of every tensor, nothing else; no model, no collective."""
    import torch
    import torch.distributed as dist

    from fsdp_fp8.format.safetensors_header import read_header
    from fsdp_fp8.shard_rows import chunk_rows

    rank, world = dist.get_rank(), dist.get_world_size()
    ranges = []  # (path, offset, nbytes)
    for path in common.checkpoint_files(Path(fp8_dir)):
        problems: list[str] = []
        header = read_header(path, problems)
        assert header is not None and not problems, problems
        for e in header.tensors.values():
            rows = e.shape[0] if e.shape else 1
            start, stop = chunk_rows(rows, world, rank) if e.shape else (0, 1)
            row = e.nbytes // rows if rows else 0
            if stop > start:
                ranges.append((path, e.begin + start * row, (stop - start) * row))
    buffer = torch.empty(sum(n for _, _, n in ranges), dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    at, fds = 0, {}
    try:
        for path, offset, n in ranges:
            fd = fds.get(path) or fds.setdefault(path, os.open(path, os.O_RDONLY))
            done = 0
            while done < n:
                done += os.preadv(fd, [view[at + done : at + n]], offset + done)
            at += n
    finally:
        for fd in fds.values():
            os.close(fd)
    return {"bytes_read": at, "held": buffer.numel(), "_keep": buffer}


def _trial_child(method, rank, world, store, fp8_dir, bf16_dir, size, device, conn) -> None:
    """One method on one rank, in a fresh process: imports first, then the measured block."""
    global DEVICE
    DEVICE = device
    harness.run_rank_child(rank, conn, lambda: _trial(method, rank, world, store, fp8_dir, bf16_dir, size, device))


def _trial(method, rank, world, store, fp8_dir, bf16_dir, size, device) -> dict:
    import safetensors.torch  # noqa: F401
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint.state_dict  # noqa: F401 - import cost outside the block

    import fsdp_fp8.compose.model  # noqa: F401

    # fsdp_fp8's __init__ is lazy: import what the methods use (TorchAO with it), or the first
    # method's measured block would pay for the imports.
    import fsdp_fp8.format.checkpoint  # noqa: F401
    import fsdp_fp8.interop.architectures  # noqa: F401
    import fsdp_fp8.models  # noqa: F401

    torch.set_num_threads(1)
    backend = "gloo"
    if device == "cuda":  # one GPU per rank (torchrun's LOCAL_RANK), NCCL between them
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        backend = "nccl"
    dist.init_process_group(backend, init_method=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    cfg = common.SIZES[size]
    fn = {"a": method_a, "b": method_b, "c": method_c, "d": method_d, "p": method_p, "n": method_n}
    fn = {**fn, "h": method_h}[method]
    dist.barrier()
    with common.PeakRSS() as mem:
        t0 = time.perf_counter()
        out = fn(fp8_dir, bf16_dir, cfg)
        dist.barrier()
        seconds = time.perf_counter() - t0
    out.pop("_keep")
    return {"rank": rank, "seconds": seconds, "rss_growth": mem.growth, **out}


def _run_trial(method, args, fp8_dir, bf16_dir) -> list[dict] | None:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    box = [None, None]
    if rank == 0:
        cold = False if args.warm else common.drop_page_cache([fp8_dir, bf16_dir])
        box = [harness.file_store(), cold]
    dist.broadcast_object_list(box)
    store, cold = box
    child = (method, rank, world, store, str(fp8_dir), str(bf16_dir), args.size, args.device)
    (result,) = harness.run_children(mp.get_context("spawn"), [(rank, _trial_child, child)], args.timeout)
    result["cold"] = cold
    gathered: list = [None] * world
    dist.all_gather_object(gathered, result)
    return gathered


def _forecast(fp8_dir, world) -> dict:
    """Per rank: the bytes it must hold (padded local shards) and read, from the plan."""
    from fsdp_fp8.format.checkpoint import open_checkpoint
    from fsdp_fp8.reading.rank_bytes import entry_rank_bytes

    ckpt = open_checkpoint(fp8_dir)
    entries = list(ckpt.tensors.values())
    return {
        "checkpoint_bytes": sum(e.nbytes for e in entries),
        "local_shard_bytes": [sum(entry_rank_bytes(e, world, r, padded=True) for e in entries) for r in range(world)],
    }


def summarize(trials: dict, args, world: int, forecast: dict) -> list[dict]:
    rows = []
    for m, runs in trials.items():
        ok = [r for r in runs if all("error" not in x for x in r)]
        if not ok:
            rows.append({"method": m, "error": next(x["error"] for r in runs for x in r if "error" in x)})
            continue
        seconds = [max(x["seconds"] for x in r) for r in ok]
        rows.append(
            {
                "method": m,
                "name": NAMES[m],
                "runs": len(ok),
                "seconds_median": statistics.median(seconds),
                "seconds_all": [round(s, 3) for s in seconds],
                "rss_growth_per_rank": [max(r[i]["rss_growth"] for r in ok) for i in range(world)],
                "bytes_read_per_rank": [ok[0][i]["bytes_read"] for i in range(world)],
                "bytes_read_total": sum(x["bytes_read"] for x in ok[0]),
                "held_per_rank": [ok[0][i]["held"] for i in range(world)],
                "cold_cache": all(x["cold"] for r in ok for x in r),
            }
        )
        if m in "ap":  # the rank-slice reads alone, without open/plan/fully_shard/to_empty
            rows[-1]["read_phase_s_median"] = statistics.median(max(x["read_phase_s"] for x in r) for r in ok)
            # The FP8 NaN-code check (fsdp_fp8.load.reader.nan_code_flag), timed inside the load, as a
            # share of the whole load_model on that rank: the reliability check's cost.
            rows[-1]["code_check_share_median"] = statistics.median(
                max(x["code_check_s"] / x["seconds"] for x in r) for r in ok
            )
            rows[-1]["code_check_s_median"] = statistics.median(max(x["code_check_s"] for x in r) for r in ok)
    by = {r["method"]: r for r in rows if "error" not in r}
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    for r in rows:
        r.update(
            bench="load",
            size=args.size,
            world_size=world,
            time=stamp,
            cpus=os.cpu_count(),
            backend="nccl" if args.device == "cuda" else "gloo",
            device=args.device,
            checkpoint_bytes=forecast["checkpoint_bytes"],
            local_shard_bytes=forecast["local_shard_bytes"],
        )
    if "a" in by:
        for other in "bcdnp":
            if other in by:
                by["a"][f"a/{other}"] = by["a"]["seconds_median"] / by[other]["seconds_median"]
    if "h" in by:  # pinned H2D GB/s per rank, over the copy alone
        runs = [r for r in trials["h"] if all("error" not in x for x in r)]
        by["h"]["h2d_gb_per_s"] = statistics.median(min(x["held"] / x["h2d_s"] for x in r) / 1e9 for r in runs)
    for m in "ad":  # read GB/s per rank (slowest rank's bytes over the method's wall time)
        if m in by:
            by[m]["gb_per_s_per_rank"] = max(by[m]["bytes_read_per_rank"]) / by[m]["seconds_median"] / 1e9
    if {"a", "d", "h"} <= set(by):
        bound = min(by["d"]["gb_per_s_per_rank"], by["h"]["h2d_gb_per_s"])
        by["a"]["gpu_target_share"] = by["a"]["gb_per_s_per_rank"] / bound  # target >= 0.8
    return rows


def format_table(rows: list[dict], world: int, forecast: dict) -> str:
    lines = [
        f"world size {world}, checkpoint (FP8) {common.mib(forecast['checkpoint_bytes'])} MiB, "
        f"local shard per rank {', '.join(common.mib(b) for b in forecast['local_shard_bytes'])} MiB",
        f"{'method':<24} {'median s':>9} {'runs s':>24} {'read total MiB':>15} "
        f"{'read/rank MiB':>22} {'peak RSS growth/rank MiB':>34} {'cold':>5}",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['method']} FAILED: {r['error'].strip().splitlines()[-1]}")
            continue
        lines.append(
            f"{r['method'] + ' ' + r['name']:<24} {r['seconds_median']:>9.3f} {str(r['seconds_all']):>24} "
            f"{common.mib(r['bytes_read_total']):>15} "
            f"{'/'.join(common.mib(b) for b in r['bytes_read_per_rank']):>22} "
            f"{'/'.join(common.mib(b) for b in r['rss_growth_per_rank']):>34} {str(r['cold_cache']):>5}"
        )
    a = next((r for r in rows if r["method"] == "a" and "error" not in r), None)
    if a:
        lines.append(
            "ratios (wall time): "
            + ", ".join(f"{k} = {a[k]:.2f}" for k in ("a/d", "a/b", "a/c", "a/n", "a/p") if k in a)
        )
        d = next((r for r in rows if r["method"] == "d" and "error" not in r), None)
        if d:
            phase = a["read_phase_s_median"]
            lines.append(
                f"a's load_checkpoint (reads + the agreement, which waits for the slowest rank's "
                f"fully_shard): {phase:.3f} s = {phase / d['seconds_median']:.2f} x d; "
                "bench/load_phases.py times the reads alone"
            )
        lines.append(
            f"a: FP8 NaN-code check {a['code_check_s_median']:.4f} thread-seconds (worst rank; summed over "
            f"the reader's workers, which run it as each read lands, overlapping the other reads: "
            f"{100 * a['code_check_share_median']:.2f}% of load_model's wall time if it were serial)"
        )
        if "gpu_target_share" in a:
            lines.append(
                f"a: {a['gb_per_s_per_rank']:.2f} GB/s per rank = {100 * a['gpu_target_share']:.0f}% of "
                "min(storage read d, pinned H2D h) (target >= 80%)"
            )
        lines.append(f"a: bytes read / checkpoint bytes = {a['bytes_read_total'] / forecast['checkpoint_bytes']:.4f}")
        bound = [1.15 * b + (64 << 20) for b in forecast["local_shard_bytes"]]
        lines.append(
            "a: peak RSS growth / (1.15 x local shard + 64 MiB) = "
            + ", ".join(f"{g / b:.2f}" for g, b in zip(a["rss_growth_per_rank"], bound))
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.methods is None:
        args.methods = CUDA_METHODS if args.device == "cuda" else "abcd"
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("bench/load.py --device cuda: skipped: no CUDA device (torch.cuda.is_available() is False)")
            return 0
    if args.setup:  # one process on a fake process group of 8: see bench/setup_cost.py
        from bench import setup_cost

        return setup_cost.main(["--results", args.results] + (["--dir", args.dir] if args.dir else []))
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout + 60))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        if rank == 0:  # build once, in its own process so this one stays small
            ctx = mp.get_context("spawn")
            with ctx.Pool(1) as pool:
                dirs = pool.apply(common.checkpoints, (args.size, args.dir))
        box = [dirs if rank == 0 else None]
        dist.broadcast_object_list(box)
        fp8_dir, bf16_dir = box[0]
        methods = [m for m in args.methods if m in METHODS]
        trials: dict[str, list] = {m: [] for m in methods}
        for rep, m in harness.interleaved(methods, args.reps):
            trials[m].append(_run_trial(m, args, fp8_dir, bf16_dir))
            if rank == 0:
                r = trials[m][-1]
                print(
                    f"rep {rep} {m}: "
                    + ("error" if any("error" in x for x in r) else f"{max(x['seconds'] for x in r):.3f} s"),
                    flush=True,
                )
        if rank == 0:
            forecast = _forecast(fp8_dir, world)
            rows = summarize(trials, args, world, forecast)
            print(format_table(rows, world, forecast), flush=True)
            common.append_jsonl(args.results, rows)
            for r in rows:
                if "error" in r:
                    print(r["error"], file=sys.stderr)
    except BaseException:
        shutdown_distributed()  # keep the traceback
        raise
    return 0


if __name__ == "__main__":
    # Destroys the group and leaves through os._exit after flushing (docs/shutdown.md).
    shutdown_distributed(main())
