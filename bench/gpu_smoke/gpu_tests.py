"""Section ``tests``: pytest on tests/gpu, one record per test as pytest reports it (a timeout
keeps those), then the same records with their messages from the junit file."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.gpu_smoke.context import Context
from bench.harness import ROOT

PYTEST_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def section_tests(ctx: Context) -> None:
    """pytest on tests/gpu, one record per test as pytest reports it (a timeout keeps those),
    then the same records again with their messages from the junit file."""
    import xml.etree.ElementTree as ET

    if ctx.fake:
        ctx.skip("pytest", "tests/gpu compare values on a real GPU; fake tensors hold none")
        return
    with tempfile.TemporaryDirectory(prefix="fsdp_fp8-smoke-") as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", str(ROOT / "tests" / "gpu")]
        cmd += [f"--junitxml={junit}", "-o", "junit_family=xunit1"]
        if ctx.quick:
            cmd += ["-k", "not demo_on_every_gpu"]  # the demo at two worlds: the demo section runs it once
        with ctx.variant("pytest") as r:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            tail: list[str] = []
            for line in proc.stdout:
                tail = (tail + [line])[-60:]
                hit = PYTEST_LINE.match(line)
                if hit:
                    outcome = hit[2]
                    status = "failed" if outcome in ("FAILED", "ERROR") else "skipped" if outcome == "SKIPPED" else "ok"
                    ctx.record(hit[1], status, outcome=outcome)
            rc = proc.wait()
            r.update(exit=rc, tail="".join(tail)[-3000:])
            if rc not in (0, 5):  # 5: nothing collected
                r["status"] = "failed"
        if junit.exists():
            for case in ET.parse(junit).getroot().iter("testcase"):
                path = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
                name = f"{path}::{case.get('name')}"
                outcome = {c.tag: (c.get("message") or "")[:1500] for c in case}
                status = "failed" if {"failure", "error"} & set(outcome) else "ok"
                status = "skipped" if "skipped" in outcome else status
                ctx.record(name, status, seconds=float(case.get("time", 0)), **outcome)
