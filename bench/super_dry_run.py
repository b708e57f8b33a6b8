"""Super-scale dry run: a ~63B-parameter MoT checkpoint as sparse files, opened, planned on
the meta device and inspected for 8 ranks, in seconds and small memory.

    python bench/super_dry_run.py [--dir DIR] [--preset super] [--world-size 8]

The checkpoint's data regions are holes (see fsdp_fp8/testing/sparse_checkpoint.py): apparent size
~65 GB, a few MB on disk. Nothing is loaded; what is shown is that everything before the
first data read scales, and the per-rank forecast the loader will follow.
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

from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.load.plan import plan_load
from fsdp_fp8.models import PRESETS, MoTConfig, build_model
from fsdp_fp8.testing.sparse_checkpoint import write_sparse_checkpoint


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", help="where to write (default: a temporary directory, removed after)")
    p.add_argument("--preset", default="super", choices=sorted(PRESETS))
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--results", default=str(Path(__file__).resolve().parent / "results.jsonl"))
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
                f"{f.rank:>4} {f.fp8_bytes / gb:>10.3f} {f.high_precision_bytes / gb:>14.3f} "
                f"{f.held_bytes / gb:>10.3f} {f.staging_peak_bytes / 2**20:>17.2f}"
            )
        with open(args.results, "a") as fh:
            fh.write(json.dumps(out, sort_keys=True) + "\n")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
