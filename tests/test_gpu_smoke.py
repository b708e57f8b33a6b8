"""bench/gpu_smoke.py in dry mode (CPU): every section runs or says why not, so the GPU smoke
check cannot rot between GPU runs. The CUDA-only parts must be reported as skipped with a
reason, never left out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from calibration import bound

ROOT = Path(__file__).resolve().parents[1]

# What only a GPU can measure: each must appear, as skipped with a reason, in a dry run.
CUDA_ONLY = [("scaled_mm", "cuda_kernels"), ("load", "h2d")]


def _skips(node, path=()):
    """(path, reason) of every skipped entry anywhere in the results."""
    if isinstance(node, dict):
        if node.get("status") == "skipped":
            yield path, node.get("reason")
        for key, value in node.items():
            yield from _skips(value, (*path, key))


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke") / "not-yet" / "smoke.json"  # its directory is created
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_smoke.py"), "--dry", "--out", str(out)],
        cwd=tmp_path_factory.mktemp("cwd"),
        env=env,
        capture_output=True,
        text=True,
        timeout=bound(840),
    )
    return proc, json.loads(out.read_text()) if out.exists() else None


@pytest.mark.timeout(900)
def test_the_dry_run_passes_every_section(dry):
    proc, results = dry
    assert proc.returncode == 0 and results is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert results["mode"] == "dry" and results["ok"] is True
    sections = results["sections"]
    assert sorted(sections) == sorted(["versions", "gemm", "scaled_mm", "hooks", "load", "step", "demo"])
    assert all(s["status"] == "ok" for s in sections.values()), {k: s["status"] for k, s in sections.items()}


@pytest.mark.timeout(900)
def test_nothing_is_skipped_silently(dry):
    _, results = dry
    skips = dict(_skips(results["sections"]))
    assert all(isinstance(reason, str) and reason for reason in skips.values()), skips
    for section, entry in CUDA_ONLY:
        assert (section, entry) in skips, (section, entry, sorted(skips))


@pytest.mark.timeout(900)
def test_the_dry_run_checks_what_the_gpu_run_checks(dry):
    _, results = dry
    s = results["sections"]
    # Every row count and input rank, with and without bias, W8A8 and W8A16.
    assert s["gemm"]["cases"] >= 2 * 6 * 3 * 2 and s["gemm"]["failures"] == []
    assert s["gemm"]["max_rel_err"] > 0  # a real comparison, not an output with itself
    assert s["scaled_mm"]["problems"] == []
    worlds = {(c["world"], c["zero_row_rank"]) for c in s["hooks"]["checks"]}
    assert {(3, True), (8, True)} <= worlds and all(
        c["bytes_equal"] and c["out_reused_equal"] for c in s["hooks"]["checks"]
    )
    load = s["load"]
    assert load["raw_read_gbps"] > 0 and load["load_model_read_gbps"] > 0 and load["load_vs_floor"] > 0
    # load_model read exactly the codes of every linear (4096 x 4096 each, 1 byte per element)
    assert load["load_model_bytes_read"] == load["fp8_linears"] * 4096 * 4096 > 0
    assert load["floor"]["name"] == "raw read"  # no CUDA: the host-to-device floors are skipped
    for name in ("BF16", "W8A8", "W8A16"):
        assert s["step"][name]["status"] == "ok" and s["step"][name]["median_ms"] > 0
    runs = s["demo"]["runs"]
    assert len(runs) == 2 and runs[0]["latent_sha256"] == runs[1]["latent_sha256"] is not None
    assert all(r["exit"] == 0 and r["bad_lines"] == [] for r in runs)
