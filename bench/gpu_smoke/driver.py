"""The driver: each section in a child process of its own (``--section NAME``) under its own
time budget, killed with its torchrun ranks at the budget; preflight first, whatever ``--only``
says, and a section preflight finds blocked skipped with the reason; a record closing each
section and a last ``summary``. No torch import here: the preflight child says what is broken."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import gpu_smoke, harness
from bench.gpu_smoke.context import Context, Results, load_results
from bench.gpu_smoke.preflight import section_preflight, wheels_to_install
from bench.gpu_smoke.sections import SECTIONS, run_section
from bench.harness import ROOT

# Seconds per section: (--quick on one H200, full run). The quick ones sum to 360 s, at the
# 6-minute goal with room for the driver; bench/gpu_smoke.sh's own timeout (--outer-timeout)
# is their sum plus TIMEOUT_MARGIN_S, so a section's budget always ends first.
BUDGETS = {
    "preflight": (10, 30),
    "versions": (15, 30),
    "tests": (80, 600),  # 100 before the decode section took 30 of the quick 6 minutes
    "gemm": (45, 120),  # the two fused variants compile on first use (inductor, triton)
    "load": (25, 180),
    "step": (40, 240),
    "allgather": (25, 90),
    "alltoall": (15, 60),
    "demo": (75, 600),  # the first run also builds the demo checkpoint into the cache
    "attention": (10, 60),
    "decode": (20, 240),
}
TIMEOUT_MARGIN_S = 60
# After a section's budget: SIGTERM, this long for torchrun to stop its ranks, then SIGKILL. The
# margin above covers it for all eight sections and the driver's own seconds.
KILL_GRACE_S = 5


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=gpu_smoke.__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON-lines results file (appended; its directory is created)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry", action="store_true", help="CPU only, scaled-down shapes")
    mode.add_argument("--fake-cuda", action="store_true", help="CUDA code paths on fake tensors (CPU build)")
    p.add_argument("--quick", action="store_true", help="the quick budgets and sizes (6 minutes on one H200)")
    p.add_argument(
        "--wheels", default=str(ROOT / "bench" / "wheels"), help="the carried wheels (preflight names the missing)"
    )
    p.add_argument("--only", help="comma-separated sections to run (default: all)")
    p.add_argument("--budget", action="append", default=[], metavar="SECTION=SECONDS", help="override a budget")
    p.add_argument("--demo-ranks", type=int, help="ranks for the demo (default: min(8, GPUs); 2 dry)")
    p.add_argument(
        "--outer-timeout", action="store_true", help="print the budgets' sum plus a margin (seconds) and exit"
    )
    p.add_argument("--wheels-to-install", action="store_true", help="print the carried wheels this Python lacks")
    p.add_argument("--section", help=argparse.SUPPRESS)  # the child process of one section
    return p.parse_args(argv)


def _child(args: argparse.Namespace) -> int:
    results = Results(Path(args.out))
    if args.section == "preflight":  # before torch: a box without a working torch is told so
        section_preflight(Context("preflight", None, args.dry, args.fake_cuda, args.quick, results.write, args))
        return 0
    import torch

    if args.fake_cuda:
        device = torch.device("cuda", 0)
    elif args.dry:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            results.write({"section": args.section, "variant": "device", "status": "failed", "error": "no CUDA"})
            return 1
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    ctx = Context(args.section, device, args.dry, args.fake_cuda, args.quick, results.write, args)
    run_section(args.section, ctx)
    return 0


def budgets(args: argparse.Namespace) -> dict[str, float]:
    chosen = {name: float(b[0] if args.quick else b[1]) for name, b in BUDGETS.items()}
    for item in args.budget:
        name, _, seconds = item.partition("=")
        if name not in chosen or not seconds:
            raise SystemExit(f"--budget {item}: expected SECTION=SECONDS with SECTION one of {', '.join(chosen)}")
        chosen[name] = float(seconds)
    return chosen


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the child's process group, wait until every member is gone (a torchrun agent
    leaves once it has stopped its ranks), SIGKILL what is left after ``KILL_GRACE_S``."""
    os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + KILL_GRACE_S
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader, or it stays in the group as a zombie
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _run_child(name: str, args: argparse.Namespace, budget: float) -> tuple[str, int | None, str]:
    """The section in its own process group, killed (with its torchrun ranks) at its budget."""
    cmd = [sys.executable, "-m", "bench.gpu_smoke", "--section", name, "--out", args.out, "--wheels", args.wheels]
    cmd += [flag for flag, on in (("--dry", args.dry), ("--fake-cuda", args.fake_cuda), ("--quick", args.quick)) if on]
    if args.demo_ranks:
        cmd += ["--demo-ranks", str(args.demo_ranks)]
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(
            cmd, env=harness.repo_env(), cwd=ROOT, stdout=err, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=budget)
            status = "ok" if rc == 0 else "crashed"
        except subprocess.TimeoutExpired:
            # SIGTERM first: torchrun starts its ranks in sessions of their own, out of this
            # group's reach, and stops them itself on SIGTERM; a SIGKILL would leave them
            # holding the GPUs for the next section.
            _stop_group(proc)
            rc, status = None, "timeout"
        err.seek(0)
        return status, rc, err.read()[-3000:]


def _blocked(name: str, pre: dict, cuda: bool) -> str | None:
    """Why preflight says ``name`` cannot run (None: it can)."""
    modules = pre.get("variants", {}).get("modules", {})
    missing = modules.get("blocks", {}).get(name)
    if missing:
        return f"preflight: missing modules {', '.join(missing)}"
    device = pre.get("variants", {}).get("device", {})
    if cuda and name != "versions" and device.get("status") == "failed":
        return f"preflight: {'; '.join(device.get('problems') or [device.get('error', 'no device')])}"
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out = str(Path(args.out).absolute())  # the children run in the checkout's root
    chosen = budgets(args)
    if args.outer_timeout:
        print(int(sum(chosen.values()) + TIMEOUT_MARGIN_S))
        return 0
    if args.wheels_to_install:
        for wheel in wheels_to_install(Path(args.wheels)):
            print(wheel)
        return 0
    if args.section:
        return _child(args)
    started = time.perf_counter()
    only = set(args.only.split(",")) if args.only else set(SECTIONS)
    unknown = only - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections: {', '.join(sorted(unknown))}; known: {', '.join(SECTIONS)}")
    results = Results(Path(args.out))
    mode = "fake-cuda" if args.fake_cuda else "dry" if args.dry else "cuda"
    results.write({"section": "run", "variant": None, "status": "ok", "mode": mode, "quick": args.quick,
                   "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "budgets_s": chosen})  # fmt: skip
    statuses = {}
    for name in ["preflight", *[s for s in SECTIONS if s != "preflight"]]:  # preflight always
        t0 = time.perf_counter()
        why = None if name == "preflight" or name in only else "not selected (--only)"
        if why is None and name != "preflight":
            preflight = load_results(Path(args.out))["sections"].get("preflight", {})
            why = _blocked(name, preflight, cuda=not (args.dry or args.fake_cuda))
        if why:
            status, rc, tail = "skipped", None, ""
        else:
            status, rc, tail = _run_child(name, args, chosen[name])
        section = load_results(Path(args.out))["sections"].get(name, {"variants": {}})
        if status == "ok" and any(v["status"] == "failed" for v in section["variants"].values()):
            status = "failed"
        if status == "ok" and not section["variants"]:
            status, tail = "failed", f"the section wrote no records to {args.out}\n{tail}"
        statuses[name] = status
        seconds = round(time.perf_counter() - t0, 2)
        end = {"section": name, "variant": None, "status": status, "seconds": seconds, "budget_s": chosen[name]}
        end.update({"reason": why} if why else {"exit": rc, "stderr_tail": tail})
        results.write(end)
        print(f"[gpu_smoke] {name:<10} {status:<8} {seconds:7.1f} s (budget {chosen[name]:.0f} s)", flush=True)
    ok = all(s in ("ok", "skipped") for s in statuses.values())
    total = round(time.perf_counter() - started, 1)
    results.write({"section": "summary", "variant": None, "ok": ok, "seconds": total, "statuses": statuses})
    print(f"[gpu_smoke] {'ok' if ok else 'FAILED'} in {total} s -> {args.out}")
    return 0 if ok else 1
