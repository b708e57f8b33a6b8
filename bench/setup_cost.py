"""FP8 set-up cost against BF16 at Super scale: rank 0 of 8, fake process group, meta device.

    python bench/setup_cost.py [--preset super] [--world-size 8] [--reps 7]

The same model is built on meta twice per repetition, interleaved: once kept BF16
(``fully_shard`` + ``to_empty``), once with its planned linears swapped to FP8 first (swap +
``fully_shard`` + ``to_empty``). No collective runs at set-up, so a ``fake`` process group
stands in for 8 ranks and nothing needs 64 GB: ``to_empty`` stays on meta. Reported: the
medians of process CPU time per phase (CPU time, not wall time, so that other processes on a
shared machine inflate both sides less) and the ratios the target is stated in. Also run by
``python bench/load.py --setup``.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.load.fsdp_wrap import shard_model
from fsdp_fp8.load.meta_build import meta_init
from fsdp_fp8.load.plan import plan_load
from fsdp_fp8.load.swap import swap_fp8_linears
from fsdp_fp8.models import PRESETS, MoTConfig, build_model
from fsdp_fp8.testing.sparse_checkpoint import write_sparse_checkpoint

PHASES = ("swap", "fully_shard", "to_empty")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="super", choices=sorted(PRESETS))
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--dir", help="where the sparse checkpoint is written (default: a temporary directory)")
    p.add_argument("--results", default=str(Path(__file__).resolve().parent / "results.jsonl"))
    return p.parse_args(argv)


def _one(config, plan, mesh, fp8: bool) -> dict[str, float]:
    with meta_init():
        model = build_model(config, device="meta")
    gc.collect()
    times = {}
    t = time.process_time()
    if fp8:
        swap_fp8_linears(model, plan)
    times["swap"] = time.process_time() - t
    t = time.process_time()
    shard_model(model, mesh)
    times["fully_shard"] = time.process_time() - t
    t = time.process_time()
    model.to_empty(device="meta")
    times["to_empty"] = time.process_time() - t
    return times


def run(args) -> dict:
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="fsdp_fp8-setup-"))
    directory = root / f"{args.preset}-sparse"
    try:
        if not (directory / "config.json").exists():
            write_sparse_checkpoint(PRESETS[args.preset], directory)
        ckpt = open_checkpoint(directory)
        config = MoTConfig.from_config_dict(ckpt.config)
        dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=args.world_size)
        try:
            mesh = init_device_mesh("cpu", (args.world_size,))
            with meta_init():
                plan = plan_load(ckpt, build_model(config, device="meta"))
            _one(config, plan, mesh, True)  # warm-up: first-call costs out of the medians
            runs = {"bf16": [], "fp8": []}
            for _ in range(args.reps):
                for kind in runs:
                    runs[kind].append(_one(config, plan, mesh, kind == "fp8"))
        finally:
            dist.destroy_process_group()
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    med = {k: {p: statistics.median(r[p] for r in v) for p in PHASES} for k, v in runs.items()}
    bf16, fp8 = med["bf16"], med["fp8"]
    return {
        "bench": "setup_cost",
        "preset": args.preset,
        "world_size": args.world_size,
        "reps": args.reps,
        "fp8_linears": len(plan.fp8),
        "torch": torch.__version__,
        "median_s": med,
        "ratio_swap_plus_fully_shard": (fp8["swap"] + fp8["fully_shard"]) / bf16["fully_shard"],
        "ratio_all": sum(fp8.values()) / (bf16["fully_shard"] + bf16["to_empty"]),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    out = run(args)
    med = out["median_s"]
    print(
        f"{args.preset}, rank 0 of {args.world_size} (fake process group, meta), {out['fp8_linears']} FP8 linears, "
        f"medians of {args.reps} interleaved runs, process CPU seconds"
    )
    print(f"{'':6} {'swap':>8} {'fully_shard':>12} {'to_empty':>9} {'total':>8}")
    for kind in ("bf16", "fp8"):
        m = med[kind]
        print(f"{kind:6} {m['swap']:8.3f} {m['fully_shard']:12.3f} {m['to_empty']:9.3f} {sum(m.values()):8.3f}")
    print(
        f"FP8 swap + fully_shard / BF16 fully_shard = {out['ratio_swap_plus_fully_shard']:.2f}; "
        f"FP8 swap + fully_shard + to_empty / BF16 fully_shard + to_empty = {out['ratio_all']:.2f}"
    )
    with open(args.results, "a") as fh:
        fh.write(json.dumps(out, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
