"""The host side of a load into an accelerator, measured without one: every row of the checkpoint
read through the staging ring (``fsdp_fp8.load.reader``) into a model left on the meta device, a
stand-in accelerator (copying into meta checks shapes and moves nothing), so what is timed is
the reads into the ring's slots and the Python around them: the host CPU a GPU load pays per byte.

    python -m bench.load_staged [--dir DIR] [--size llama-3.4g] [--reps 3] [--direct auto|on|off]
                                [--raw dd-direct-1,cat-2]

One process (world 1: it reads every byte of the checkpoint), the page cache evicted before each
repetition and each raw read (``/proc/sys/vm/drop_caches`` where writable, else
``POSIX_FADV_DONTNEED`` per file), the imports and the model's set-up outside the clock. Each
repetition first times the floor, the raw reads of the same files (``bench/load_floor.py``'s
methods), then the staged load. Printed per repetition and as medians: wall seconds, GB/s, CPU
seconds per GB (user and sys, every thread), minor faults, how it read, the load average, and the
load against the fastest raw read (time and CPU per GB). Beside it, the same command of an older
tree gives the before / after.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from pathlib import Path

from bench import load_floor, peer_checkpoints
from fsdp_fp8.format.checkpoint import open_checkpoint
from fsdp_fp8.interop.architectures import resolve_model_spec
from fsdp_fp8.load import reader
from fsdp_fp8.load.meta_build import meta_init
from fsdp_fp8.load.plan import plan_load
from fsdp_fp8.load.swap import swap_fp8_linears
from fsdp_fp8.reading import read_choice
from fsdp_fp8.reading.read_options import ReadOptions


def trial(directory: Path, direct: bool | None, evict: str) -> dict:
    ckpt = open_checkpoint(directory)
    try:
        with meta_init():
            model = resolve_model_spec(ckpt.config).model_fn(ckpt.config)
        plan = plan_load(ckpt, model)
        swap_fp8_linears(model, plan)
        files = sorted(directory.glob("*.safetensors"))
        evicted = load_floor.evict(files, evict)
        handles = list(ckpt.handles.values())
        entries = [t.entry.weight for t in plan.fp8] + [t.entry for t in plan.tensors]
        ranges = sorted(((e.handle, e.begin, e.nbytes) for e in entries), key=lambda r: (r[0].name, r[1]))
        choice, problems = read_choice.choose_reads(ReadOptions(direct=direct), handles, ranges)
        assert not problems, problems
        ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        rows = reader._load_local(model, plan, options=choice.options)
        seconds, ru1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    finally:
        ckpt.close()
    gb = rows.bytes_read / 1e9
    return {
        "seconds": seconds,
        "gb": gb,
        "user_per_gb": (ru1.ru_utime - ru0.ru_utime) / gb,
        "sys_per_gb": (ru1.ru_stime - ru0.ru_stime) / gb,
        "minor_faults": ru1.ru_minflt - ru0.ru_minflt,
        "reads": choice.why,
        "evicted": evicted,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", help="checkpoint cache (as bench/load_floor.py)")
    p.add_argument("--size", default="llama-3.4g", choices=sorted(peer_checkpoints.SHAPES))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--direct", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--evict", choices=("auto", "drop_caches", "fadvise"), default="auto")
    p.add_argument("--raw", default="dd-direct-1,cat-2", help=f"the floor: raw reads of {', '.join(load_floor.RAW)}")
    args = p.parse_args(argv)
    directory = peer_checkpoints.llama_checkpoint(args.size, args.dir)
    direct = {"auto": None, "on": True, "off": False}[args.direct]
    raw = [m for m in args.raw.split(",") if m]
    unknown = sorted(set(raw) - set(load_floor.RAW))
    if unknown:
        p.error(f"--raw {','.join(unknown)}: not one of {', '.join(load_floor.RAW)}")
    runs, floors = [], {m: [] for m in raw}
    for rep in range(args.reps):
        load = os.getloadavg()
        for method in raw:
            floors[method].append(_floor_trial(directory, method, args.evict))
            print(f"rep {rep} {method}: {floors[method][-1]['seconds']:.2f} s", flush=True)
        r = trial(directory, direct, args.evict)
        runs.append(r)
        print(
            f"rep {rep}: {r['seconds']:.2f} s, {r['gb'] / r['seconds']:.2f} GB/s, CPU/GB {r['user_per_gb']:.3f} user"
            f" + {r['sys_per_gb']:.3f} sys, {r['minor_faults']:,} minor faults; {r['reads']}; evicted: {r['evicted']};"
            f" load average {load[0]:.2f}",
            flush=True,
        )
    med = {k: statistics.median(r[k] for r in runs) for k in ("seconds", "user_per_gb", "sys_per_gb", "minor_faults")}
    print(
        f"median of {len(runs)}: {med['seconds']:.2f} s, CPU/GB {med['user_per_gb']:.3f} user + {med['sys_per_gb']:.3f}"
        f" sys = {med['user_per_gb'] + med['sys_per_gb']:.3f}, {med['minor_faults']:,.0f} minor faults"
    )
    if raw:
        file_bytes = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        print(_against_the_floor(med, file_bytes, floors))
    return 0


def _floor_trial(directory: Path, method: str, evict: str) -> dict:
    """One raw read of the checkpoint's files (``load_floor.raw_trial``) from a cold cache."""
    files = sorted(directory.glob("*.safetensors"))
    load_floor.evict(files, evict)
    return load_floor.raw_trial(method, files)


def _against_the_floor(med: dict, file_bytes: int, floors: dict[str, list[dict]]) -> str:
    """The medians of the raw reads (of ``file_bytes``: the files, headers too), and the load
    against the fastest, in time and in CPU per GB."""
    rows = load_floor.summarize(floors, file_bytes)
    fastest = min((m for m in rows if "error" not in rows[m]), key=lambda m: rows[m]["seconds"])
    lines = [f"{m}: {r['seconds']:.2f} s, CPU/GB {r['cpu_s_per_gb']:.3f}, runs {r['runs']}" for m, r in rows.items()]
    cpu = med["user_per_gb"] + med["sys_per_gb"]
    lines.append(
        f"load / floor ({fastest}): {med['seconds'] / rows[fastest]['seconds']:.2f} in time,"
        f" {cpu / rows[fastest]['cpu_s_per_gb']:.2f} in CPU per GB"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
