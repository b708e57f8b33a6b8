"""Super-scale dry run: a ~63B-parameter MoT checkpoint as sparse files, opened, planned on
the meta device and inspected for 8 ranks, in seconds and small memory.

    python -m bench.super_dry_run [--dir DIR] [--preset super] [--world-size 8]
    python -m bench.super_dry_run --load [--rank 0]       # + rank 0's load, open to ready, by phase

The checkpoint's data regions are holes (see fsdp_fp8/testing/sparse_checkpoint.py): apparent size
~65 GB, a few MB on disk. Without ``--load`` nothing is loaded; what is shown is that everything
before the first data read scales, and the per-rank forecast the loader will follow.

``--load`` then runs one rank's load from open to ready as ``load_model`` runs it, in this one
process, as rank ``--rank`` of ``--world-size`` on a ``fake`` process group, wall time per phase:
open, meta build, plan, swap, ``shard_model``, ``to_empty`` onto the CPU (the rank's shard for
real: 8.1 GB for rank 0 of 8 at Super scale) and the rank-slice reads (``reader.read_rows``:
every pread of its rows, the holes reading as zeros, and the FP8 NaN-code check). The two
agreements need live peers and are not run; neither is the prefetch (the page cache holds no
hole). Refused, with what it would need, when ``MemAvailable`` is below the shard + 1 GiB.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import common, harness
from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.load.plan import plan_load
from fsdp_fp8.models import PRESETS, MoTConfig, build_model
from fsdp_fp8.testing.sparse_checkpoint import write_sparse_checkpoint


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def rank_load(directory: Path, world: int, rank: int, held_bytes: int) -> dict:
    """One rank's load from open to ready, as load_model runs its steps; wall seconds per phase."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_fp8.interop.architectures import resolve_model_spec
    from fsdp_fp8.load import reader
    from fsdp_fp8.load.fsdp_wrap import shard_model
    from fsdp_fp8.load.meta_build import materialize, meta_init
    from fsdp_fp8.load.swap import swap_fp8_linears
    from fsdp_fp8.reading import slice_reader

    phases = harness.Phases()  # wall and process CPU (every thread, user + system) seconds
    out: dict = {"rank": rank, "world_size": world, "held_bytes": held_bytes}
    out.update(phases_s=phases.seconds, phases_cpu_s=phases.cpu)
    available = _mem_available()
    out["mem_available_bytes"] = available
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        ckpt = phases.run("open", lambda: open_checkpoint(directory))

        def build():
            with meta_init():
                return resolve_model_spec(ckpt.config).model_fn(ckpt.config)

        model = phases.run("meta build", build)
        plan = phases.run("plan", lambda: plan_load(ckpt, model))
        phases.run("swap", lambda: swap_fp8_linears(model, plan))
        phases.run("fully_shard", lambda: shard_model(model, mesh))
        if available < held_bytes + (1 << 30):
            out["stopped"] = (
                f"to_empty onto the CPU needs this rank's {held_bytes / 2**30:.1f} GiB + 1 GiB; "
                f"MemAvailable is {available / 2**30:.1f} GiB"
            )
            return out
        phases.run("to_empty (cpu)", lambda: materialize(model, torch.device("cpu")))
        slice_reader.reset_bytes_read()
        try:
            with torch.no_grad():
                rows = phases.run("reads", lambda: reader.read_rows(model, plan))
            held, checked_s = rows.bytes_held, rows.code_check_seconds
        finally:  # reading a hole puts a zero page in the page cache: 8 GB of them at Super scale
            for path in directory.glob("*.safetensors"):
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        out["bytes_read"] = slice_reader.bytes_read()
        out["bytes_held"] = held
        out["code_check_thread_s"] = checked_s
        out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out["cpus"] = os.cpu_count()
        ckpt.close()
    finally:
        dist.destroy_process_group()
    return out


def print_rank_load(load: dict, args) -> None:
    phases = load["phases_s"]
    print(
        f"\nrank {load['rank']} of {load['world_size']}: open to ready, wall s (fake process group; "
        "the agreements and the prefetch are not run)"
    )
    cpu = load["phases_cpu_s"]
    print(f"  {'phase':<16} {'wall s':>8} {'CPU s':>8}")
    for name, seconds in phases.items():
        print(f"  {name:<16} {seconds:8.3f} {cpu[name]:8.3f}")
    print(f"  {'total':<16} {sum(phases.values()):8.3f} {sum(cpu.values()):8.3f}")
    if "stopped" in load:
        print(f"  stopped before to_empty: {load['stopped']}")
        return
    gb = load["bytes_read"] / 1e9
    print(
        f"  read {gb:.2f} GB ({gb / phases['reads']:.2f} GB/s over the reads, holes: no disk), held "
        f"{load['bytes_held'] / 1e9:.2f} GB, FP8 NaN-code check {load['code_check_thread_s']:.2f} thread-s, "
        f"peak RSS {load['peak_rss_bytes'] / 2**30:.2f} GiB"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", help="where to write (default: a temporary directory, removed after)")
    p.add_argument("--preset", default="super", choices=sorted(PRESETS))
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--results", default=str(common.RESULTS))
    p.add_argument("--load", action="store_true", help="also run one rank's load, open to ready, by phase")
    p.add_argument("--rank", type=int, default=0, help="the rank --load runs as")
    args = p.parse_args(argv)
    config = PRESETS[args.preset]
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="fsdp_fp8-super-"))
    directory = root / f"{args.preset}-sparse"
    out: dict = {"bench": "super_dry_run", "preset": args.preset, "world_size": args.world_size}
    try:
        t = time.perf_counter()
        if not (directory / "config.json").exists():
            write_sparse_checkpoint(config, directory)
        out["write_s"] = time.perf_counter() - t
        files = list(directory.iterdir())
        out["apparent_bytes"] = sum(f.stat().st_size for f in files)
        out["disk_bytes"] = sum(f.stat().st_blocks * 512 for f in files)

        t = time.perf_counter()
        ckpt = open_checkpoint(directory)
        out["open_s"] = time.perf_counter() - t
        out["tensors"] = len(ckpt.tensors)
        out["fp8_linears"] = len(ckpt.fp8_modules)

        t = time.perf_counter()
        with torch.device("meta"):
            model = build_model(MoTConfig.from_config_dict(ckpt.config), device="meta")
        out["params"] = sum(p.numel() for p in model.parameters())
        plan = plan_load(ckpt, model)
        out["meta_build_and_plan_s"] = time.perf_counter() - t
        out["peak_rss_mib_in_process"] = _rss_mib()
        forecasts = [plan.forecast(args.world_size, r) for r in range(args.world_size)]
        out["forecast"] = [vars(f) for f in forecasts]

        t = time.perf_counter()
        cli = subprocess.run(
            [
                sys.executable,
                "-c",
                "import resource, sys; from fsdp_fp8.cli.commands import main; code = main(sys.argv[1:]);"
                " print(f'maxrss_kib {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}'); sys.exit(code)",
                "inspect",
                str(directory),
                "--world-size",
                str(args.world_size),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        out["inspect_s"] = time.perf_counter() - t
        report, _, rss = cli.stdout.rpartition("maxrss_kib ")
        out["inspect_peak_rss_mib"] = int(rss) / 1024
        print(report.rstrip())
        print()
        gb = 1e9
        print(
            f"{args.preset}: {out['params'] / 1e9:.2f}B params, {out['tensors']} tensors "
            f"({out['fp8_linears']} FP8 linears) in {len(files) - 3} shard files; "
            f"apparent {out['apparent_bytes'] / gb:.1f} GB, on disk {out['disk_bytes'] / 2**20:.1f} MiB"
        )
        print(
            f"write {out['write_s']:.2f} s, open_checkpoint {out['open_s']:.2f} s, meta build + plan "
            f"{out['meta_build_and_plan_s']:.2f} s (peak RSS {out['peak_rss_mib_in_process']:.0f} MiB), "
            f"inspect --world-size {args.world_size} {out['inspect_s']:.2f} s "
            f"(peak RSS {out['inspect_peak_rss_mib']:.0f} MiB)"
        )
        print(f"{'rank':>4} {'FP8 GB':>10} {'high prec. GB':>14} {'held GB':>10} {'staging peak MiB':>17}")
        for f in forecasts:
            print(
                f"{f.shard:>4} {f.fp8_bytes / gb:>10.3f} {f.high_precision_bytes / gb:>14.3f} "
                f"{f.held_bytes / gb:>10.3f} {f.staging_peak_bytes / 2**20:>17.2f}"
            )
        if args.load:
            out["load"] = rank_load(directory, args.world_size, args.rank, forecasts[args.rank].held_bytes)
            print_rank_load(out["load"], args)
        with open(args.results, "a") as fh:
            fh.write(json.dumps(out, sort_keys=True) + "\n")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
