"""NCCL at the largest world the box allows (one GPU per rank): the uint8 all-gather of uneven
shards, zero-row ranks included, gives every rank the full E4M3 codes, fresh and into the
previous output (``out=``). Skipped without CUDA; at one GPU it runs at world 1 (NCCL refuses
two ranks on one GPU). The worker is tests/gpu/uneven_allgather.py, which the smoke check's
``allgather`` section times."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[2]


def test_uneven_allgather_at_the_largest_world_gives_back_the_codes(tmp_path):
    world = torch.cuda.device_count()
    report = tmp_path / "allgather.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd += [str(ROOT / "tests" / "gpu" / "uneven_allgather.py"), "--report", str(report), "--large"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(report.read_text())
    assert got["backend"] == "nccl" and got["world"] == world
    records = got["records"]
    assert len({r["rank"] for r in records}) == world
    assert [r for r in records if not (r["bytes_equal"] and r["out_reused_equal"])] == []
    if world > 1:  # fewer rows than ranks: some rank sent only padding
        assert any(r["local_rows"] == 0 for r in records)


def test_ulysses_all_to_alls_at_the_largest_world_give_back_the_rows(tmp_path):
    world = torch.cuda.device_count()
    if world < 2:
        pytest.skip("a Ulysses group needs two GPUs (NCCL refuses two ranks on one)")
    report = tmp_path / "alltoall.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd += [str(ROOT / "tests" / "gpu" / "ulysses_all_to_all.py"), "--report", str(report), "--large"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(report.read_text())
    assert got["backend"] == "nccl" and got["world"] == world
    assert [r for r in got["records"] if not (r["heads_equal"] and r["round_trip_equal"])] == []
