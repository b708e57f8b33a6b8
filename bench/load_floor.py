"""The load beside the storage's own floor: raw reads, ``load_model`` and DCP's reader, one run.

    python -m bench.load_floor [--dir DIR] [--reps 3] [--world 2] [--size llama-3.4g]
                               [--load fsdp_fp8,fsdp_fp8+buffered] [--evict auto|drop_caches|fadvise]
                               [--host fresh-2,readinto-2] [--host-memory as-is|settled|kept]

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
  fresh-N    N processes faulting in fresh anonymous memory the size of their files, nothing read:
             what any load into host memory pays besides the read
  readinto-N N processes reading their files (buffered) into fresh anonymous memory held to the
             end: a reference for a load into host memory (not a floor: it pays page-cache pages too)

Host memory (``bench/host_memory.py``): on a VM whose balloon reports free pages to its host, a
first touch of memory the host has taken back costs several times more, so which method comes
right after an eviction matters. ``--host-memory as-is`` runs as the machine is; ``settled``
waits after each eviction until the guest stops handing memory back (a load on a VM left idle);
``kept`` (root) turns the reporting off for the run and first touches ``--warm-gb`` once
(bare-metal-like). Each trial says how many MiB the guest handed back from its eviction (in
``settled``: from the end of the wait) to its end.

The floor is the fastest raw method's median (``cat``, ``dd``; the host-memory methods are
printed beside it, never as it). Printed: each method's median wall seconds and CPU
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
import contextlib
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import common, harness, host_memory, peer_checkpoints, peer_load

RAW = ("cat-1", "cat-2", "cat-4", "cat-8", "dd-direct-1", "dd-direct-4")
# Beside the floor: what any load into host memory pays besides the read (``fresh-N``), and a
# buffered read into fresh host memory (``readinto-N``, a reference: it pays page-cache pages too).
HOST = ("fresh-2", "readinto-2")
_HOST_METHOD = re.compile(r"(fresh|readinto)-[1-9][0-9]*")
_CHILD = """
import mmap, os, resource, sys, time
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime
what, MADV_POPULATE_WRITE, paths = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
u0, s0 = cpu()
t0 = time.monotonic()
areas = []
for path in paths:
    size = os.path.getsize(path)
    area = mmap.mmap(-1, size)
    areas.append(area)
    if what == "fresh":
        area.madvise(MADV_POPULATE_WRITE)
        continue
    fd, view, done = os.open(path, os.O_RDONLY), memoryview(area), 0
    while done < size:
        got = os.preadv(fd, [view[done:]], done)
        if got <= 0:
            raise SystemExit(f"{path}: short read at {done}")
        done += got
    view.release()
    os.close(fd)
t1 = time.monotonic()
u1, s1 = cpu()
print(t0, t1, u1 - u0, s1 - s0)
"""


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


def _python_trial(method: str, files: list[Path]) -> dict:
    """``fresh-N``: N processes, each faulting in fresh anonymous memory the size of its files
    (``MADV_POPULATE_WRITE``), nothing read; ``readinto-N``: each reading its files (buffered,
    the kernel's readahead) into fresh anonymous memory, held until the end, as a load holds its
    shards. Timed (``CLOCK_MONOTONIC``, one clock for every process) from the first process's
    start of work to the last one's end, interpreter
    start and exit left out (as the load's imports and teardown are); CPU as each measured it."""
    what, streams = method.rsplit("-", 1)
    groups = [files[i :: int(streams)] for i in range(int(streams))]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, what, str(host_memory.MADV_POPULATE_WRITE), *map(str, g)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for g in groups
        if g
    ]
    done = [p.communicate() for p in procs]
    outs = [out.split() for out, _ in done]
    if any(p.returncode for p in procs) or any(len(o) != 4 for o in outs):
        why = next((err.strip() for _, err in done if err.strip()), str(outs))
        return {"seconds": float("nan"), "cpu_user_s": 0.0, "cpu_sys_s": 0.0, "error": f"{method} failed: {why}"}
    starts, ends, users, syss = zip(*[[float(x) for x in o] for o in outs])
    return {"seconds": max(ends) - min(starts), "cpu_user_s": sum(users), "cpu_sys_s": sum(syss)}


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
        f"{'method':<22} {'median s':>9} {'GB/s':>6} {'user s/GB':>10} {'sys s/GB':>9} {'CPU s/GB':>9} "
        f"{'to host MiB':>11}  runs",
    ]
    gb = nbytes / 1e9
    for m, r in rows.items():
        if "error" in r:
            lines.append(f"{m:<22} FAILED: {r['error'].strip().splitlines()[-1]}")
            continue
        handed = f"{r['handed_back_mib']:>11.0f}" if "handed_back_mib" in r else f"{'-':>11}"
        lines.append(
            f"{m:<22} {r['seconds']:>9.2f} {gb / r['seconds']:>6.2f} {r['cpu_user_s'] / gb:>10.3f} "
            f"{r['cpu_sys_s'] / gb:>9.3f} {r['cpu_s_per_gb']:>9.3f} {handed}  {r['runs']}"
        )
    raw = {m: r for m, r in rows.items() if m in RAW and "error" not in r}
    cats = {m: r for m, r in raw.items() if m.startswith("cat")}
    floor = min(raw, key=lambda m: raw[m]["seconds"]) if raw else None
    cat = min(cats, key=lambda m: cats[m]["seconds"]) if cats else None
    if floor:
        lines.append(f"floor: {floor} {raw[floor]['seconds']:.2f} s; fastest cat: {cat}")
    for m, r in rows.items():
        if m.startswith("fsdp_fp8") and "error" not in r:
            lines += _load_lines(m, r, rows, floor, cat)
    return "\n".join(lines)


def _load_lines(name: str, r: dict, rows: dict[str, dict], floor: str | None, cat: str | None) -> list[str]:
    """One load's ratios to the floor, DCP and ``cat`` (those that ran), beside the host-memory
    references, and where its time went."""
    said = [f"load/floor {r['seconds'] / rows[floor]['seconds']:.3f} (<= 1.15)"] if floor else []
    if "seconds" in rows.get("dcp-1", {}):
        said.append(f"load/DCP {r['seconds'] / rows['dcp-1']['seconds']:.3f} (<= 0.8)")
    if cat:
        said.append(f"CPU/GB over {cat}'s {r['cpu_s_per_gb'] / rows[cat]['cpu_s_per_gb']:.3f} (<= 1.2)")
    lines = [f"{name}: " + "; ".join(said)] if said else []
    lines += _beside_host_memory(name, r, rows)
    lines.append(
        f"  {name}: reads {r['reads_s']:.2f} s ({r['reads_cpu_s']:.2f} CPU-s, slowest rank), set-up "
        f"{r['setup_s']:.2f} s (slowest rank; the medians may be of different trials), minor faults "
        f"{r['minor_faults']:,.0f}, NaN-code check {r['code_check_thread_s']:.2f} thread-s; reads: {r['reads']}"
    )
    return lines


def _beside_host_memory(name: str, load: dict, rows: dict[str, dict]) -> list[str]:
    """The load beside what any load into host memory pays (the fresh memory alone, ``fresh-N``)
    and a buffered read into fresh memory (``readinto-N``)."""
    into = {m: r for m, r in rows.items() if m.startswith("readinto") and "error" not in r}
    fresh = {m: r for m, r in rows.items() if m.startswith("fresh") and "error" not in r}
    said = []
    if into:
        best = min(into, key=lambda m: into[m]["seconds"])
        said.append(
            f"load/{best} {load['seconds'] / into[best]['seconds']:.2f} in time, "
            f"{load['cpu_s_per_gb'] / into[best]['cpu_s_per_gb']:.2f} in CPU per GB"
        )
    if fresh:
        least = min(fresh, key=lambda m: fresh[m]["cpu_s_per_gb"])
        said.append(
            f"fresh memory alone ({least}) {fresh[least]['cpu_s_per_gb']:.3f} CPU-s/GB, "
            f"{fresh[least]['cpu_s_per_gb'] / load['cpu_s_per_gb']:.0%} of the load's"
        )
    return [f"  {name} beside host memory: " + "; ".join(said)] if said else []


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", help="checkpoint cache (default $FSDP_FP8_BENCH_DIR or $TMPDIR/fsdp_fp8_bench)")
    p.add_argument("--size", default="llama-3.4g", choices=sorted(peer_checkpoints.SHAPES))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--raw", default=",".join(RAW), help=f"raw reads to time, of {', '.join(RAW)}")
    p.add_argument("--host", default=",".join(HOST), help="host-memory floors: fresh-N, readinto-N ('' for none)")
    p.add_argument(
        "--host-memory",
        choices=("as-is", "settled", "kept"),
        default="as-is",
        help="settled: each trial waits for the guest to stop handing memory back after the eviction; kept: free "
        "page reporting off for the run, memory first touched once (root; restored after)",
    )
    p.add_argument("--warm-gb", type=float, default=12.0, help="with --host-memory kept: GB first touched before")
    p.add_argument("--load", default="fsdp_fp8", help="load methods (peer_load names, what-ifs included)")
    p.add_argument("--dcp", default="dcp-1", help="DCP methods ('' for none)")
    p.add_argument("--evict", choices=("auto", "drop_caches", "fadvise"), default="auto")
    p.add_argument("--results", default=str(common.RESULTS))
    p.add_argument("--timeout", type=float, default=600.0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    directory = peer_checkpoints.llama_checkpoint(args.size, args.dir)
    files = common.checkpoint_files(directory)
    nbytes = sum(f.stat().st_size for f in files)
    raw = [m for m in args.raw.split(",") if m and (not m.startswith("dd") or _direct_ok(files[0]))]
    if args.host_memory == "settled" and host_memory.reported_mib() is None:
        raise SystemExit("--host-memory settled: this kernel does not count what it hands back (no reported_kib)")
    host = [m for m in args.host.split(",") if m]
    loads = [m for m in args.load.split(",") + args.dcp.split(",") if m]
    unknown = [m for m in raw if m not in RAW] + [m for m in host if not _HOST_METHOD.fullmatch(m)]
    unknown += [m for m in loads if not peer_load._known(m)]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(peer_load.PRELOAD)
    row_bytes = peer_load.rank_row_bytes(directory, args.world)
    imports = import_seconds()
    before = harness.load_average()
    methods = raw + host + loads
    memory = (
        host_memory.kept(int(args.warm_gb * 1e9))
        if args.host_memory == "kept"
        else contextlib.nullcontext(
            f"host memory: {args.host_memory} (free page reporting order {host_memory.reporting_order()}"
            + ("; each trial after the guest stopped handing memory back)" if args.host_memory == "settled" else ")")
        )
    )
    with memory as memory_state:
        print(memory_state, flush=True)
        trials, evictions = _trials(args, methods, files, ctx, directory, row_bytes)
    rows = summarize(trials, nbytes)
    head = (
        f"\n{directory}: {nbytes / 1e9:.2f} GB in {len(files)} files; W={args.world} gloo; {args.reps} interleaved "
        f"reps, medians; {os.cpu_count()} CPUs; load average {before} -> {harness.load_average()}; eviction: "
        f"{', '.join(sorted(evictions))}; imports (fresh interpreter, not in any figure) {imports:.2f} s; "
        f"{memory_state}"
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
                "load_average": f"{before} -> {harness.load_average()}",
                **r,
            }
            for m, r in rows.items()
        ],
    )
    return 1 if any("error" in r for r in rows.values()) else 0


def _trials(args, methods, files, ctx, directory, row_bytes) -> tuple[dict[str, list[dict]], set[str]]:
    """Every method ``args.reps`` times, the order rotated each repetition, the files evicted
    before each trial; a trial also records the MiB the guest handed back to its host from the
    eviction to its end (``host_memory``: memory its next first touch pays the host for)."""
    trials, evictions = {m: [] for m in methods}, set()
    for rep, m in harness.interleaved(methods, args.reps):
        handed = host_memory.reported_mib()
        evictions.add(evict(files, args.evict))
        if args.host_memory == "settled":
            host_memory.settle()
            handed = host_memory.reported_mib()  # what the trial's own first touches free and hand back
        if m in RAW:
            r = raw_trial(m, files)
        elif _HOST_METHOD.fullmatch(m):
            r = _python_trial(m, files)
        else:
            r = load_trial(ctx, m, args.world, directory, row_bytes, args.timeout)
        if handed is not None:
            r["handed_back_mib"] = host_memory.reported_mib() - handed
        trials[m].append(r)
        print(
            f"rep {rep} {m}: {r['seconds']:.2f} s, CPU {r['cpu_user_s']:.2f} user + {r['cpu_sys_s']:.2f} sys"
            + (f", {r['handed_back_mib']:.0f} MiB handed back to the host" if handed is not None else "")
            + (f" error: {r['error'].strip().splitlines()[-1]}" if "error" in r else ""),
            flush=True,
        )
    return trials, evictions


if __name__ == "__main__":
    sys.exit(main())
