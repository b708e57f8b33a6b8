"""The load beside the storage's own floor: raw reads, ``load_model`` and DCP's reader, one run.

    python bench/load_floor.py [--dir DIR] [--reps 3] [--world 2] [--size llama-3.4g]
                               [--load fsdp_fp8,fsdp_fp8+buffered] [--evict auto|drop_caches|fadvise]

Builds (once, under ``--dir``) the Llama-shaped ModelOpt FP8 checkpoint (``bench/peer_checkpoints.py``:
``llama-3.4g`` is hidden 4096, MLP 14336, 14 layers, 3.58 GB in 16 files), then, every repetition,
in an order rotated each time, evicts the files from the page cache and times each method:

  cat-N      N parallel ``cat`` processes (N in 1, 2, 4, 8), the files dealt out round-robin,
             output to /dev/null: the buffered raw read
  dd-direct  ``dd bs=8M iflag=direct`` per file, 1 stream, then 4 (where the file system takes
             O_DIRECT): the raw read past the page cache
  fsdp_fp8   ``load_model(None, dir)`` at W ranks on gloo, each rank a fresh process whose imports
             are done before the clock starts (fork server); ``--load`` adds what-ifs
             (``bench/peer_load.py``: ``+buffered``, ``+direct``, ``+noprefetch``, ...)
  dcp-1      DCP's ``HuggingFaceStorageReader(thread_count=1)`` into a ``fully_shard``-ed plain
             FP8 model at W ranks (``bench/peer_load.py``'s peer)

The floor is the fastest raw method's median. Printed: each method's median wall seconds and CPU
seconds per GB of the checkpoint (user and sys, every process and thread of the method), load /
floor, load / DCP, load's CPU per GB over the fastest ``cat``'s, the load averages before and
after, what the eviction did, the imports' seconds (a fresh interpreter's, apart), and how each
load read (``LoadReport.reads``). JSON lines go to ``--results``.

Eviction: ``/proc/sys/vm/drop_caches`` (root; the whole machine's clean page cache, so runs on a
shared machine slow the others a little) where it can be written, else ``POSIX_FADV_DONTNEED``
on each file; checked with ``RWF_NOWAIT`` reads of sampled pages either way.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import peer_checkpoints  # noqa: E402
import peer_load  # noqa: E402

RAW = ("cat-1", "cat-2", "cat-4", "cat-8", "dd-direct-1", "dd-direct-4")


def evict(files: list[Path], how: str) -> str:
    """Evict ``files`` from the page cache; what was done and what is still resident."""
    done = "fadvise"
    if how in ("auto", "drop_caches"):
        try:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
            done = "drop_caches"
        except OSError as exc:
            if how == "drop_caches":
                raise SystemExit(f"--evict drop_caches: {exc}") from exc
    if done == "fadvise":
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    cached = sum(_cached_pages(p) for p in files)
    return done if not cached else f"{done} ({cached} sampled pages still cached)"


def _cached_pages(path: Path, samples: int = 8) -> int:
    size, fd = path.stat().st_size, os.open(path, os.O_RDONLY)
    try:
        hits = 0
        for i in range(samples):
            at = (size * i // samples) & ~4095
            try:
                hits += os.preadv(fd, [bytearray(4096)], at, os.RWF_NOWAIT) > 0
            except OSError:
                pass
        return hits
    finally:
        os.close(fd)


def _direct_ok(path: Path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return (
            subprocess.run(
                ["dd", f"if={path}", "of=/dev/null", "bs=4096", "count=1", "iflag=direct"], capture_output=True
            ).returncode
            == 0
        )
    except OSError:
        return False


def raw_trial(method: str, files: list[Path]) -> dict:
    """Run ``method`` as N child processes; wall seconds and their summed user / sys seconds."""
    streams = int(method.rsplit("-", 1)[1])
    groups = [files[i::streams] for i in range(streams)]
    if method.startswith("cat"):
        commands = [["cat", *map(str, g)] for g in groups if g]
    else:  # one dd per file, each stream's files one after the other
        dd = "dd if={} of=/dev/null bs=8M iflag=direct status=none"
        commands = [["sh", "-c", "; ".join(dd.format(f) for f in g)] for g in groups if g]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(c, stdout=subprocess.DEVNULL) for c in commands]
    user = sys_s = 0.0
    failed = []
    for p in procs:
        _, status, usage = os.wait4(p.pid, 0)
        user, sys_s = user + usage.ru_utime, sys_s + usage.ru_stime
        p.returncode = os.waitstatus_to_exitcode(status)
        failed += [p.args] if p.returncode else []
    out = {"seconds": time.perf_counter() - t0, "cpu_user_s": user, "cpu_sys_s": sys_s}
    return out | ({"error": f"{failed[0]} failed"} if failed else {})


def load_trial(ctx, method: str, world: int, directory: Path, row_bytes: list[int], timeout: float) -> dict:
    """One W-rank trial of ``method`` (``peer_load``): wall of the slowest rank, CPU summed over ranks."""
    ranks = peer_load.run_trial(ctx, method, world, directory, "evicted", {"row_bytes": row_bytes}, timeout)
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return {"seconds": float("nan"), "cpu_user_s": 0.0, "cpu_sys_s": 0.0, "error": errors[0]}
    return {
        "seconds": max(r["seconds"] for r in ranks),
        "cpu_user_s": sum(r["cpu_user_s"] for r in ranks),
        "cpu_sys_s": sum(r["cpu_sys_s"] for r in ranks),
        "reads_cpu_s": max(r["phases_cpu"].get("reads", 0.0) for r in ranks),
        "reads_s": max(r["phases"].get("reads", 0.0) for r in ranks),
        "setup_s": max(sum(v for k, v in r["phases"].items() if k != "reads") for r in ranks),
        "minor_faults": sum(r.get("minor_faults", 0) for r in ranks),
        "code_check_thread_s": max(r.get("code_check_thread_s", 0.0) for r in ranks),
        "reads": ranks[0].get("reads", ""),
    }


def import_seconds() -> float:
    """What a fresh interpreter pays to import what a load needs (kept out of the load's figure)."""
    code = "import time; t=time.perf_counter(); " + "; ".join(f"import {m}" for m in peer_load.PRELOAD)
    code += "; print(time.perf_counter()-t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


def summarize(trials: dict[str, list[dict]], nbytes: int) -> dict[str, dict]:
    out = {}
    for method, runs in trials.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            out[method] = {"error": runs[0]["error"]}
            continue
        med = {k: statistics.median(r[k] for r in ok) for k in ok[0] if isinstance(ok[0][k], (int, float))}
        med["cpu_s_per_gb"] = (med["cpu_user_s"] + med["cpu_sys_s"]) / (nbytes / 1e9)
        med["runs"] = [round(r["seconds"], 2) for r in ok]
        med["reads"] = ok[0].get("reads", "")
        out[method] = med
    return out


def report(rows: dict[str, dict], nbytes: int, head: str) -> str:
    lines = [
        head,
        f"{'method':<22} {'median s':>9} {'GB/s':>6} {'user s/GB':>10} {'sys s/GB':>9} {'CPU s/GB':>9}  runs",
    ]
    gb = nbytes / 1e9
    for m, r in rows.items():
        if "error" in r:
            lines.append(f"{m:<22} FAILED: {r['error'].strip().splitlines()[-1]}")
            continue
        lines.append(
            f"{m:<22} {r['seconds']:>9.2f} {gb / r['seconds']:>6.2f} {r['cpu_user_s'] / gb:>10.3f} "
            f"{r['cpu_sys_s'] / gb:>9.3f} {r['cpu_s_per_gb']:>9.3f}  {r['runs']}"
        )
    raw = {m: r for m, r in rows.items() if m in RAW and "error" not in r}
    cats = {m: r for m, r in raw.items() if m.startswith("cat")}
    dcp = rows.get("dcp-1", {})
    if raw:
        floor = min(raw, key=lambda m: raw[m]["seconds"])
        cat = min(cats, key=lambda m: cats[m]["seconds"]) if cats else None
        lines.append(f"floor: {floor} {raw[floor]['seconds']:.2f} s; fastest cat: {cat}")
        for m, r in rows.items():
            if not m.startswith("fsdp_fp8") or "error" in r:
                continue
            said = [f"load/floor {r['seconds'] / raw[floor]['seconds']:.2f} (<= 1.15)"]
            if "seconds" in dcp:
                said.append(f"load/DCP {r['seconds'] / dcp['seconds']:.2f} (<= 0.8)")
            if cat:
                said.append(f"CPU/GB over {cat}'s {r['cpu_s_per_gb'] / cats[cat]['cpu_s_per_gb']:.2f} (<= 1.2)")
            lines.append(f"{m}: " + "; ".join(said))
            lines.append(
                f"  {m}: reads {r['reads_s']:.2f} s ({r['reads_cpu_s']:.2f} CPU-s, slowest rank), set-up "
                f"{r['setup_s']:.2f} s, minor faults {r['minor_faults']:,.0f}, NaN-code check "
                f"{r['code_check_thread_s']:.2f} thread-s; reads: {r['reads']}"
            )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", help="checkpoint cache (default $FSDP_FP8_BENCH_DIR or $TMPDIR/fsdp_fp8_bench)")
    p.add_argument("--size", default="llama-3.4g", choices=sorted(peer_checkpoints.SHAPES))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--raw", default=",".join(RAW), help=f"raw reads to time, of {', '.join(RAW)}")
    p.add_argument("--load", default="fsdp_fp8", help="load methods (peer_load names, what-ifs included)")
    p.add_argument("--dcp", default="dcp-1", help="DCP methods ('' for none)")
    p.add_argument("--evict", choices=("auto", "drop_caches", "fadvise"), default="auto")
    p.add_argument("--results", default=str(Path(__file__).resolve().parent / "results.jsonl"))
    p.add_argument("--timeout", type=float, default=600.0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    directory = peer_checkpoints.llama_checkpoint(args.size, args.dir)
    files = common.checkpoint_files(directory)
    nbytes = sum(f.stat().st_size for f in files)
    raw = [m for m in args.raw.split(",") if m and (not m.startswith("dd") or _direct_ok(files[0]))]
    loads = [m for m in args.load.split(",") + args.dcp.split(",") if m]
    unknown = [m for m in raw if m not in RAW] + [m for m in loads if not peer_load._known(m)]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(peer_load.PRELOAD)
    row_bytes = peer_load.rank_row_bytes(directory, args.world)
    imports = import_seconds()
    before = _load_average()
    methods, trials, evictions = raw + loads, {m: [] for m in raw + loads}, set()
    for rep in range(args.reps):
        for m in methods[rep % len(methods) :] + methods[: rep % len(methods)]:
            evictions.add(evict(files, args.evict))
            r = raw_trial(m, files) if m in RAW else load_trial(ctx, m, args.world, directory, row_bytes, args.timeout)
            trials[m].append(r)
            print(
                f"rep {rep} {m}: {r['seconds']:.2f} s, CPU {r['cpu_user_s']:.2f} user + {r['cpu_sys_s']:.2f} sys"
                + (f" error: {r['error'].strip().splitlines()[-1]}" if "error" in r else ""),
                flush=True,
            )
    rows = summarize(trials, nbytes)
    head = (
        f"\n{directory}: {nbytes / 1e9:.2f} GB in {len(files)} files; W={args.world} gloo; {args.reps} interleaved "
        f"reps, medians; {os.cpu_count()} CPUs; load average {before} -> {_load_average()}; eviction: "
        f"{', '.join(sorted(evictions))}; imports (fresh interpreter, not in any figure) {imports:.2f} s"
    )
    print(report(rows, nbytes, head), flush=True)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    common.append_jsonl(
        args.results,
        [
            {
                "bench": "load_floor",
                "time": stamp,
                "method": m,
                "checkpoint_bytes": nbytes,
                "world_size": args.world,
                "load_average": f"{before} -> {_load_average()}",
                **r,
            }
            for m, r in rows.items()
        ],
    )
    return 1 if any("error" in r for r in rows.values()) else 0


def _load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
