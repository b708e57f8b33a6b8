"""FP8 set-up cost against BF16 at Super scale, by phase: rank 0 of 8, fake process group, meta device.

    python -m bench.setup_cost [--preset super] [--world-size 8] [--reps 7]
    python -m bench.setup_cost --profile [--top 12]      # cProfile of one FP8 set-up, per phase

Each repetition sets the same stack up twice, interleaved:

  fp8   what ``load_model`` does before its first read: ``open_checkpoint`` (index, headers,
        every scale read and checked), the meta build (``resolve_model_spec(config).model_fn``
        under ``meta_init``, as ``plan_model`` builds it), ``plan_load``, the FP8 swap,
        ``shard_model`` (``fully_shard`` per block, then the root), ``to_empty``
  bf16  what a plain BF16 FSDP2 user does: the model built under ``torch.device("meta")``,
        ``shard_model``, ``to_empty``
  plain fp8   bf16 with the planned linears' weights replaced by plain ``float8_e4m3fn``
        parameters and 0-d scale buffers ("swap"): what sharding the FP8 bytes costs without
        a tensor subclass (the model bench/peer_load.py hands DCP)

No collective runs at set-up, so a ``fake`` process group stands in for 8 ranks and nothing
needs 64 GB (``to_empty`` stays on meta). Reported: medians of process CPU time per phase (CPU,
not wall, time: other processes on a shared machine inflate both sides less; wall medians are
in the JSON too) and the ratios the target is stated in:

  setup ratio  fp8 (open + meta build + plan + swap + fully_shard) / bf16 (meta build + fully_shard)
  vs fully_shard   the same fp8 sum / bf16 fully_shard alone
  swap + fully_shard   fp8 (swap + fully_shard) / bf16 fully_shard (the ratio this bench gave before)

and, per phase, the CPU seconds of the cyclic garbage collector's passes (``gc.callbacks``) with
the full (generation 2) passes counted, and the ratios with those seconds taken out of both sides:
Python runs a full pass once the objects that survived since the last one exceed a quarter of
all tracked objects, so whether a run pays one (~0.3 s here) depends on the process's heap as
much as on the set-up's own objects.

Also run by ``python -m bench.load --setup``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from bench import common, harness
from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.interop.architectures import resolve_model_spec
from fsdp_fp8.load.fsdp_wrap import shard_model
from fsdp_fp8.load.meta_build import meta_init
from fsdp_fp8.load.plan import plan_load
from fsdp_fp8.load.swap import swap_fp8_linears
from fsdp_fp8.models import PRESETS, MoTConfig, build_model
from fsdp_fp8.testing.sparse_checkpoint import write_sparse_checkpoint

PHASES = ("open", "meta build", "plan", "swap", "fully_shard", "to_empty")
SETUP = ("open", "meta build", "plan", "swap", "fully_shard")  # what the target counts


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="super", choices=sorted(PRESETS))
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--dir", help="where the sparse checkpoint is written (default: a temporary directory)")
    p.add_argument("--results", default=str(common.RESULTS))
    p.add_argument("--profile", action="store_true", help="cProfile one FP8 set-up, phase by phase, and print the top")
    p.add_argument("--top", type=int, default=12, help="functions per phase in --profile (by own time)")
    return p.parse_args(argv)


class _Collector:
    """CPU seconds the cyclic garbage collector ran, and its passes per generation, while on."""

    def __init__(self):
        self.cpu = 0.0
        self.passes = [0, 0, 0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.process_time()
        else:
            self.cpu += time.process_time() - self._start
            self.passes[info["generation"]] += 1


class _Clock:
    """CPU and wall seconds per phase, the collector's share of the CPU seconds; optionally one
    cProfile per phase."""

    def __init__(self, profile: bool = False):
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        self.gc: dict[str, float] = {}
        self.gc_passes: dict[str, list[int]] = {}
        self.profiles: dict[str, cProfile.Profile] = {}
        self._profile = profile

    def run(self, name: str, fn):
        prof = cProfile.Profile() if self._profile else None
        collector = _Collector()
        gc.callbacks.append(collector)
        try:
            c, w = time.process_time(), time.perf_counter()
            if prof:
                prof.enable()
            out = fn()
            if prof:
                prof.disable()
                self.profiles[name] = prof
            self.cpu[name] = time.process_time() - c
            self.wall[name] = time.perf_counter() - w
        finally:
            gc.callbacks.remove(collector)
        self.gc[name], self.gc_passes[name] = collector.cpu, collector.passes
        return out


def _fp8(directory: Path, mesh, profile: bool = False) -> _Clock:
    """load_model's steps before its first read, on meta."""
    clock = _Clock(profile)
    ckpt = clock.run("open", lambda: open_checkpoint(directory))

    def build():
        with meta_init():
            return resolve_model_spec(ckpt.config).model_fn(ckpt.config)

    model = clock.run("meta build", build)
    plan = clock.run("plan", lambda: plan_load(ckpt, model))
    clock.run("swap", lambda: swap_fp8_linears(model, plan))
    clock.run("fully_shard", lambda: shard_model(model, mesh))
    clock.run("to_empty", lambda: model.to_empty(device="meta"))
    clock.fp8_linears = len(plan.fp8)
    clock.fp8_modules = [t.module for t in plan.fp8]
    ckpt.close()
    return clock


def _bf16(config: MoTConfig, mesh, profile: bool = False) -> _Clock:
    """A plain BF16 FSDP2 set-up of the same stack."""
    clock = _Clock(profile)
    for phase in ("open", "plan", "swap"):
        clock.cpu[phase] = clock.wall[phase] = clock.gc[phase] = 0.0
        clock.gc_passes[phase] = [0, 0, 0]

    def build():
        with torch.device("meta"):
            return build_model(config, device="meta")

    model = clock.run("meta build", build)
    clock.run("fully_shard", lambda: shard_model(model, mesh))
    clock.run("to_empty", lambda: model.to_empty(device="meta"))
    return clock


def _plain_fp8(config: MoTConfig, modules: list[str], mesh) -> _Clock:
    """The BF16 set-up with the planned linears' weights made plain ``float8_e4m3fn`` parameters
    and their scales 0-d buffers (the model bench/peer_load.py hands DCP): what sharding FP8
    bytes costs without a tensor subclass."""
    clock = _Clock()
    for phase in ("open", "plan"):
        clock.cpu[phase] = clock.wall[phase] = clock.gc[phase] = 0.0
        clock.gc_passes[phase] = [0, 0, 0]

    def build():
        with torch.device("meta"):
            return build_model(config, device="meta")

    def cast():
        for name in modules:
            linear = model.get_submodule(name)
            shape = linear.weight.shape
            linear._parameters["weight"] = torch.nn.Parameter(
                torch.empty(shape, dtype=torch.float8_e4m3fn, device="meta"), requires_grad=False
            )
            linear.register_buffer("weight_scale", torch.empty((), device="meta"))
            linear.register_buffer("input_scale", torch.empty((), device="meta"))

    model = clock.run("meta build", build)
    clock.run("swap", cast)
    clock.run("fully_shard", lambda: shard_model(model, mesh))
    clock.run("to_empty", lambda: model.to_empty(device="meta"))
    return clock


def _median(clocks: list[_Clock], attr: str) -> dict[str, float]:
    return {p: statistics.median(getattr(c, attr)[p] for c in clocks) for p in PHASES}


def _median_mutator(clocks: list[_Clock]) -> dict[str, float]:
    """CPU seconds per phase with the collector's passes taken out, median over the runs."""
    return {p: statistics.median(c.cpu[p] - c.gc[p] for c in clocks) for p in PHASES}


def ratios(fp8: dict[str, float], bf16: dict[str, float]) -> dict[str, float]:
    setup = sum(fp8[p] for p in SETUP)
    return {
        "setup_ratio": setup / (bf16["meta build"] + bf16["fully_shard"]),
        "setup_vs_bf16_fully_shard": setup / bf16["fully_shard"],
        "swap_plus_fully_shard": (fp8["swap"] + fp8["fully_shard"]) / bf16["fully_shard"],
        "all_with_to_empty": sum(fp8.values()) / (bf16["meta build"] + bf16["fully_shard"] + bf16["to_empty"]),
    }


def run(args) -> dict:
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="fsdp_fp8-setup-"))
    directory = root / f"{args.preset}-sparse"
    profiles = None
    try:
        if not (directory / "config.json").exists():
            write_sparse_checkpoint(PRESETS[args.preset], directory)
        config = MoTConfig.from_config_dict(json.loads((directory / "config.json").read_text()))
        dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=args.world_size)
        try:
            mesh = init_device_mesh("cpu", (args.world_size,))
            warm = _fp8(directory, mesh)  # warm-up: first-call costs out of the medians
            _bf16(config, mesh)
            modules = warm.fp8_modules
            runs: dict[str, list[_Clock]] = {"bf16": [], "fp8": [], "plain fp8": []}
            for _, kind in harness.interleaved(runs, args.reps):
                gc.collect()
                if kind == "bf16":
                    runs[kind].append(_bf16(config, mesh))
                elif kind == "fp8":
                    runs[kind].append(_fp8(directory, mesh))
                else:
                    runs[kind].append(_plain_fp8(config, modules, mesh))
            if args.profile:
                gc.collect()
                profiles = {"fp8": _fp8(directory, mesh, profile=True).profiles}
                gc.collect()
                profiles["bf16"] = _bf16(config, mesh, profile=True).profiles
        finally:
            dist.destroy_process_group()
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    med = {k: _median(v, "cpu") for k, v in runs.items()}
    wall = {k: _median(v, "wall") for k, v in runs.items()}
    collector = {k: _median(v, "gc") for k, v in runs.items()}
    mutator = {k: _median_mutator(v) for k, v in runs.items()}
    full_passes = {k: [sum(c.gc_passes[p][2] for p in PHASES) for c in v] for k, v in runs.items()}
    out = {
        "bench": "setup_cost",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "preset": args.preset,
        "world_size": args.world_size,
        "reps": args.reps,
        "fp8_linears": warm.fp8_linears,
        "torch": torch.__version__,
        "median_cpu_s": med,
        "median_wall_s": wall,
        "ratios_cpu": ratios(med["fp8"], med["bf16"]),
        "plain_fp8_fully_shard_vs_bf16_cpu": med["plain fp8"]["fully_shard"] / med["bf16"]["fully_shard"],
        "ratios_wall": ratios(wall["fp8"], wall["bf16"]),
        "median_gc_cpu_s": collector,
        "median_cpu_without_gc_s": mutator,
        "ratios_cpu_without_gc": ratios(mutator["fp8"], mutator["bf16"]),
        "full_gc_passes_per_run": full_passes,
        "load_average": harness.load_average(),
    }
    return out, profiles


def _own_times(prof: cProfile.Profile) -> dict[tuple, tuple[int, float]]:
    """(file, line, function) -> (calls, own seconds)."""
    return {k: (v[1], v[2]) for k, v in pstats.Stats(prof).stats.items()}


def _where(key: tuple) -> str:
    file, line, fn = key
    return f"{fn}  {Path(file).parent.name}/{Path(file).name}:{line}" if file != "~" else f"{fn}  (C)"


def profile_table(profiles: dict[str, dict[str, cProfile.Profile]], top: int) -> str:
    """Per FP8 phase: its profiled own time and calls, and the functions with the most own time;
    for the phases BF16 has too, the functions by FP8's excess over BF16 (own time)."""
    lines = []
    for phase, prof in profiles["fp8"].items():
        fp8 = _own_times(prof)
        total, calls = sum(t for _, t in fp8.values()), sum(n for n, _ in fp8.values())
        bf16 = _own_times(profiles["bf16"][phase]) if phase in profiles["bf16"] else None
        extra = ""
        if bf16 is not None:
            b_total, b_calls = sum(t for _, t in bf16.values()), sum(n for n, _ in bf16.values())
            extra = f" (bf16: {b_total:.3f} s, {b_calls:,} calls)"
        lines.append(f"{phase}: fp8 {total:.3f} s own time under cProfile, {calls:,} calls{extra}")
        if bf16 is None:
            for key, (n, t) in sorted(fp8.items(), key=lambda kv: kv[1][1], reverse=True)[:top]:
                lines.append(f"  {t:8.3f} s {n:>8,} calls  {_where(key)}")
            continue
        excess = {k: (n - bf16.get(k, (0, 0.0))[0], t - bf16.get(k, (0, 0.0))[1]) for k, (n, t) in fp8.items()}
        lines.append("  excess over bf16 (own s, calls):")
        for key, (n, t) in sorted(excess.items(), key=lambda kv: kv[1][1], reverse=True)[:top]:
            lines.append(f"  {t:+8.3f} s {n:>+8,} calls  {_where(key)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    out, profiles = run(args)
    print(
        f"{args.preset}, rank 0 of {args.world_size} (fake process group, meta), {out['fp8_linears']} FP8 linears, "
        f"medians of {args.reps} interleaved runs, process CPU seconds (load average {out['load_average']})"
    )
    print(f"{'':10}" + "".join(f"{p:>12}" for p in PHASES) + f"{'set-up':>10}")
    for kind in ("bf16", "fp8", "plain fp8"):
        m = out["median_cpu_s"][kind]
        print(f"{kind:10}" + "".join(f"{m[p]:12.3f}" for p in PHASES) + f"{sum(m[p] for p in SETUP):10.3f}")
    r, w = out["ratios_cpu"], out["ratios_wall"]
    print(
        f"set-up ratio fp8 (open + meta build + plan + swap + fully_shard) / bf16 (meta build + fully_shard) = "
        f"{r['setup_ratio']:.2f} (wall {w['setup_ratio']:.2f}; target <= 1.3); / bf16 fully_shard alone = "
        f"{r['setup_vs_bf16_fully_shard']:.2f}; fp8 swap + fully_shard / bf16 fully_shard = "
        f"{r['swap_plus_fully_shard']:.2f}; everything incl. to_empty = {r['all_with_to_empty']:.2f}"
    )
    g = out["ratios_cpu_without_gc"]
    print("of which the cyclic garbage collector (CPU s, median per phase; full passes per run):")
    for kind in ("bf16", "fp8", "plain fp8"):
        m = out["median_gc_cpu_s"][kind]
        print(
            f"{kind:10}" + "".join(f"{m[p]:12.3f}" for p in PHASES) + f"{sum(m[p] for p in SETUP):10.3f}"
            f"   full passes {out['full_gc_passes_per_run'][kind]}"
        )
    print(
        f"without the collector's passes: set-up ratio {g['setup_ratio']:.2f}; / bf16 fully_shard alone "
        f"{g['setup_vs_bf16_fully_shard']:.2f}; swap + fully_shard / bf16 fully_shard {g['swap_plus_fully_shard']:.2f}"
    )
    print(
        "plain fp8 (the planned weights as plain float8_e4m3fn parameters, scales as buffers: no tensor "
        f"subclass): fully_shard / bf16 fully_shard = {out['plain_fp8_fully_shard_vs_bf16_cpu']:.2f}"
    )
    if profiles:
        print("\ncProfile of one FP8 set-up (own time per function; cProfile inflates Python-heavy phases):")
        print(profile_table(profiles, args.top))
    with open(args.results, "a") as fh:
        fh.write(json.dumps(out, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
