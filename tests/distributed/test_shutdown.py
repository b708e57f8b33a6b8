"""shutdown_distributed: FSDP2 + gloo ranks launched by torchrun exit 0, every time.

Without it, about one run in eight to fifteen aborts at interpreter exit (docs/shutdown.md),
so three runs in a row catch a regression only sometimes (a quarter to a third); the count
is kept small for CI time (~5 s a run on an idle 2-core box, ~20 s under load).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from calibration import bound

from fsdp_fp8.runtime.shutdown import shutdown_distributed

WORKER = Path(__file__).parents[1] / "shutdown_worker.py"
RUNS = 3


def _torchrun(*worker_args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # --standalone: a c10d rendezvous on a free port, never a fixed one.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(WORKER), *worker_args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=bound(60), env=env)


@pytest.mark.timeout(120)
def test_ranks_exit_zero_every_time():
    for run in range(RUNS):
        proc = _torchrun()
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"run {run}: exit code {proc.returncode}\n{output}"
        assert "terminate called" not in output, f"run {run}:\n{output}"
        # Two ranks share one pipe, so a line may be split by the other rank's text: match
        # the reports, not lines.
        reports = sorted(re.findall(r"rank (\d) exact (True|False) sum (-?\d+\.\d{6})", proc.stdout))
        assert [(rank, exact) for rank, exact, _ in reports] == [("0", "True"), ("1", "True")], output
        assert reports[0][2] == reports[1][2], reports
        for rank in range(2):
            assert f"rank {rank} atexit ran" in proc.stdout, f"run {run}:\n{output}"
            assert f"rank {rank} logged before exit" in proc.stderr, f"run {run}:\n{output}"


@pytest.mark.parametrize("code", [-1, 256, True, 1.0, "0"])
def test_bad_exit_code_is_refused_before_anything_happens(code):
    with pytest.raises(ValueError, match="exit_code"):
        shutdown_distributed(code)


def test_without_exit_code_it_returns(monkeypatch):
    # No process group here: nothing to destroy, and the process must go on.
    assert shutdown_distributed() is None


def _shutdown_after_a_peer_failed(rank, world, failed):
    """Rank 0 waits in an all-reduce rank 1 never joins (it failed); both then shut down."""
    import time

    import torch
    import torch.distributed as dist

    from fsdp_fp8.runtime import shutdown

    destroyed = []
    real = dist.destroy_process_group
    # A tripwire: on the failure path nothing may call destroy (on NCCL it would wait for the
    # queued all-reduce forever); elsewhere it must, and then really destroys.
    dist.destroy_process_group = lambda *a, **k: (destroyed.append(rank), real(*a, **k))[1]
    # Both ranks connected first: gloo's init can return on rank 1 while rank 0 is still meshing,
    # and rank 1 aborting then ends rank 0's init instead (seen on a loaded machine).
    dist.barrier()
    try:
        work = dist.all_reduce(torch.ones(4), async_op=True) if rank == 0 else None
        t0 = time.monotonic()
        shutdown.shutdown_distributed(failed=failed)
        seconds = time.monotonic() - t0
    finally:
        dist.destroy_process_group = real
    del work
    return {"destroyed": bool(destroyed), "initialized": dist.is_initialized(), "seconds": seconds}


@pytest.mark.parametrize("failed", [True, False])
def test_the_failure_path_aborts_instead_of_destroying(failed):
    from ranks import run_ranks

    if failed:
        results = run_ranks(_shutdown_after_a_peer_failed, 2, True, timeout=60)
        for r in results:
            assert not r["destroyed"] and not r["initialized"], r
            assert r["seconds"] < bound(10), r
    else:  # a clean exit destroys (finalizes) the group; no collective is pending then
        results = run_ranks(_shutdown_after_a_peer_failed, 1, False, timeout=60)
        assert results[0]["destroyed"] and not results[0]["initialized"]


@pytest.mark.timeout(120)
def test_a_failing_exit_code_aborts_and_still_runs_atexit():
    proc = _torchrun("--exit-code", "3")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output  # torchrun reports the ranks' exit code 3 as a failure
    assert "exitcode  : 3" in output or "exitcode: 3" in output.replace(" ", ""), output
    assert "destroy_process_group called" not in output, output
    for rank in range(2):
        assert f"rank {rank} atexit ran" in proc.stdout, output


_LATE_SIGNAL = """
import atexit, os, signal, sys, time
from fsdp_fp8.cli import commands, runner

def outcome(args):
    print("error: the rank's one line", file=sys.stderr, flush=True)
    return 1

def torchrun_stops_the_ranks():  # as torchrun does once another rank has failed
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)

runner.execute = outcome
atexit.register(torchrun_stops_the_ranks)
sys.exit(commands.main(["run", "--steps", "1"]))
"""


def test_a_signal_after_the_outcome_is_printed_adds_nothing(tmp_path):
    """torchrun's SIGTERM reaching a rank in its exit's clean-up (``atexit``), after the rank
    printed its one line: the exit code stays the rank's, and no traceback follows the line."""
    assert _exit_and_stderr(_LATE_SIGNAL, tmp_path) == (1, "error: the rank's one line\n")


_SIGNAL_WHILE_A_FAILED_RUN_IS_FREED = """
import os, signal, sys
from fsdp_fp8.cli import commands, runner

class PipelinePart:  # what a failed load or generation leaves in its frames
    def __del__(self):  # torchrun's SIGTERM arriving while the failed run's frames are freed
        os.kill(os.getpid(), signal.SIGTERM)

def run(args):
    part = PipelinePart()
    raise RuntimeError("rank 1 ended during the pipeline's load or generation")

runner.init_distributed = lambda timeout_s: None
runner.run = run
sys.exit(commands.main(["run", "--steps", "1"]))
"""


def test_a_signal_while_a_failed_run_is_freed_adds_nothing(tmp_path):
    """The real ``execute`` prints a failure's one line, then leaves the ``except`` clause, which
    frees the failed run's frames (weak references' callbacks, ``__del__``); torchrun's SIGTERM
    arriving then must not add an ``Exception ignored in`` traceback (seen once in CI)."""
    expected = "error: rank 1 ended during the pipeline's load or generation\n"
    assert _exit_and_stderr(_SIGNAL_WHILE_A_FAILED_RUN_IS_FREED, tmp_path) == (1, expected)


def _exit_and_stderr(script: str, cwd: Path) -> tuple[int, str]:
    """``script`` run as a launcher rank's process (``python -c``): its exit code and stderr."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=bound(60), env=env, cwd=cwd
    )
    return proc.returncode, proc.stderr
