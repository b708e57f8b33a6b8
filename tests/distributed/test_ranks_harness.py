"""The multi-rank harness itself: results, failures, hangs and deaths, all bounded in time.

No assertion here depends on how fast the machine is: which guard stopped a run (a failure's
grace, a straggler's grace, the timeout) is read from its message, and a bound in seconds is
only ever a lower one (a guard never fires early) or scaled by ``calibration.slowdown()``."""

from __future__ import annotations

import os
import re
import sys
import time

import pytest
import torch
import torch.distributed as dist
from calibration import bound
from ranks import FAIL_GRACE_S, LAG_GRACE_S, RanksFailed, run_ranks


def _all_reduce_rank(rank: int, world_size: int, offset: int, *, scale: int = 1):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"rank": rank, "world": world_size, "sum": t.item(), "tag": (offset + rank) * scale,
            "backend": dist.get_backend()}  # fmt: skip


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_come_back_in_rank_order(world_size):
    results = run_ranks(_all_reduce_rank, world_size, 10, scale=2)
    total = world_size * (world_size + 1) / 2
    assert results == [
        {"rank": r, "world": world_size, "sum": total, "tag": (10 + r) * 2, "backend": "gloo"}
        for r in range(world_size)
    ]


def _raise_on_rank_1(rank: int, world_size: int):
    if rank == 1:
        raise RuntimeError("rank 1 broke on purpose")
    dist.barrier()  # the others are stuck here until gloo notices rank 1 is gone
    return rank


def test_raising_rank_fails_fast_with_its_traceback():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_raise_on_rank_1, 3, timeout=600)
    message = str(info.value)
    assert "rank 1 raised:" in message
    assert "RuntimeError: rank 1 broke on purpose" in message
    assert "_raise_on_rank_1" in message  # the traceback, not just the exception text
    assert "timed out" not in message, message  # stopped by the failure, not at the timeout


def _raise_everywhere(rank: int, world_size: int):
    raise ValueError(f"bad value on rank {rank}")


def test_every_failing_rank_is_reported():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_raise_everywhere, 2)
    message = str(info.value)
    assert "2 of 2 ranks failed" in message
    for rank in range(2):
        assert f"rank {rank} raised:" in message
        assert f"ValueError: bad value on rank {rank}" in message


def _hang_on_rank_0(rank: int, world_size: int):
    if rank == 0:
        time.sleep(3600)
    return rank


def test_hanging_rank_fails_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_hang_on_rank_0, 2, timeout=0.5)  # short: the test lasts the scaled timeout
    elapsed = time.monotonic() - start
    # Rank 1 is not checked: on a loaded 2-core box it may not have started within the timeout.
    assert "rank 0 returned no result and was killed" in str(info.value)
    scaled = float(re.search(r"(?:timed out after|still running) ([0-9.]+) s", str(info.value)).group(1))
    assert elapsed >= scaled  # the guard never fires early; that it fires at all ends this test


def test_rank_hanging_after_the_others_finished_fails_before_the_timeout(monkeypatch):
    # Stopped by the straggler's grace, not the 600 s timeout: the message says which guard. A
    # short grace: the test lasts it, times the slowdown (up to 16 on two cores busy with the suite).
    import ranks

    monkeypatch.setattr(ranks, "LAG_GRACE_S", 0.5)
    pattern = r"still running [0-9.]+ s after the last other rank finished \(0.5 s on the reference"
    with pytest.raises(RanksFailed, match=pattern) as info:
        run_ranks(_hang_on_rank_0, 2, timeout=600)
    assert "rank 1" not in str(info.value)


def _hang_in_collective(rank: int, world_size: int):
    if rank == 0:
        time.sleep(3600)
    dist.barrier()


def test_ranks_stuck_in_a_collective_fail_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(RanksFailed, match=r"timed out after [0-9.]+ s \(0.5 s on the reference machine") as info:
        run_ranks(_hang_in_collective, 2, timeout=0.5)  # short: the test lasts it, scaled
    assert "2 of 2 ranks failed" in str(info.value)
    scaled = float(re.search(r"timed out after ([0-9.]+) s", str(info.value)).group(1))
    assert 0.5 <= scaled <= time.monotonic() - start  # scaled up, never down, and not early


def _exit_on_rank_1(rank: int, world_size: int):
    if rank == 1:
        os._exit(3)
    dist.barrier()
    return rank


def test_rank_that_exits_early_fails_fast():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_exit_on_rank_1, 2, timeout=600)
    assert "rank 1 exited with code 3 before returning a result" in str(info.value)
    assert "timed out" not in str(info.value)  # stopped by the death, not at the timeout


def _segfault_on_rank_0(rank: int, world_size: int):
    if rank == 0:
        import ctypes

        ctypes.string_at(0)  # SIGSEGV
    return rank


def test_rank_that_segfaults_fails_fast():
    with pytest.raises(RanksFailed, match="rank 0 died of SIGSEGV before returning a result") as info:
        run_ranks(_segfault_on_rank_0, 2, timeout=600)
    assert "timed out" not in str(info.value)


def _environment_and_stderr(rank: int, world_size: int, speak: bool = True):
    if speak:
        print(f"rank {rank} writes to the test's stderr", file=sys.stderr, flush=True)
    return os.environ.get("FSDP_FP8_TEST_PROBE")


def test_a_rank_has_the_environment_and_the_stderr_of_the_test(monkeypatch, capfd):
    # A rank forked from the fork server would otherwise see the server's environment and
    # write to the stderr the server started with, not this test's capture.
    monkeypatch.delenv("FSDP_FP8_TEST_PROBE", raising=False)
    with capfd.disabled():  # a fork server this run starts gets other streams than the capture below
        assert run_ranks(_environment_and_stderr, 1, False) == [None]
    for value in ("first", "second"):  # the server outlives a run: the second must not see the first
        monkeypatch.setenv("FSDP_FP8_TEST_PROBE", value)
        assert run_ranks(_environment_and_stderr, 2) == [value, value]
        err = capfd.readouterr().err
        assert "rank 0 writes to the test's stderr" in err and "rank 1 writes to the test's stderr" in err, err


def _abort_after_returning(rank: int, world_size: int):
    import atexit

    # What FSDP2 + gloo sometimes does on CPU (docs/shutdown.md): the result is correct, then
    # the process dies of SIGABRT at interpreter exit.
    atexit.register(os.abort)
    return rank * 10


def test_abort_after_delivering_a_result_is_success():
    results = run_ranks(_abort_after_returning, 2)
    assert results == [0, 10]
    assert results.exitcodes == [-6, -6]
    assert set(results.late_deaths) == {0, 1}
    assert "SIGABRT after delivering its result" in results.late_deaths[0]


def _unpicklable_result(rank: int, world_size: int):
    return lambda: rank


def test_unpicklable_result_is_a_failure_with_its_reason():
    with pytest.raises(RanksFailed, match="rank 0 raised:(.|\n)*pickle"):
        run_ranks(_unpicklable_result, 1)


def _check_process_group_is_gloo(rank: int, world_size: int):
    return dist.is_initialized(), dist.get_backend(), dist.get_world_size(), dist.get_rank()


def test_rank_runs_with_an_initialised_gloo_group():
    assert run_ranks(_check_process_group_is_gloo, 2) == [(True, "gloo", 2, 0), (True, "gloo", 2, 1)]


def _fail_while_rank_0_sleeps(rank: int, world_size: int):
    if rank == 1:
        raise RuntimeError(f"failed at {time.monotonic():.3f}")  # CLOCK_MONOTONIC: one clock per machine
    time.sleep(3600)  # not in a collective: nothing but the harness can stop it


def test_a_straggler_is_killed_fail_grace_after_another_rank_failed(monkeypatch):
    import ranks

    monkeypatch.setattr(ranks, "FAIL_GRACE_S", 0.5)  # short: the test lasts it, scaled
    with pytest.raises(RanksFailed) as info:
        run_ranks(_fail_while_rank_0_sleeps, 2, timeout=600)
    message = str(info.value)
    after = time.monotonic() - float(re.search(r"RuntimeError: failed at ([0-9.]+)", message).group(1))
    grace = re.search(
        r"rank 0 returned no result and was killed: it was still running ([0-9.]+) s after another rank "
        r"failed \(0.5 s on the reference machine",
        message,
    )
    assert grace, message  # the failure's grace stopped it, not the 600 s timeout
    assert 0.5 <= float(grace.group(1)) <= after, (grace.group(1), after)  # scaled up, never early


def _fail_once_rank_0_is_stopped(rank: int, world_size: int):
    import signal

    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    if rank == 0:
        os.kill(os.getpid(), signal.SIGSTOP)  # only the harness ends it now
    while open(f"/proc/{pids[0]}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
        time.sleep(0.01)
    raise RuntimeError("rank 1 failed beside a stopped rank 0")


def test_a_stopped_rank_is_killed_once_another_failed_without_the_grace(monkeypatch):
    """A rank stopped by SIGSTOP cannot report whatever the grace: once another rank has failed
    it is killed at once (the heartbeat tests stop ranks on purpose), and the message says why."""
    import ranks

    monkeypatch.setattr(ranks, "FAIL_GRACE_S", 30.0)  # waited out, the message would say so
    with pytest.raises(RanksFailed) as info:
        run_ranks(_fail_once_rank_0_is_stopped, 2, timeout=600)
    message = str(info.value)
    assert "RuntimeError: rank 1 failed beside a stopped rank 0" in message, message
    assert (
        "rank 0 returned no result and was killed: it was stopped by a signal (state T) when another rank failed"
        in message
    ), message


def _barrier_without_rank_0(rank: int, world_size: int, flag: str):
    if rank == 0:
        while not os.path.exists(flag):  # never joins the barrier; returns once rank 1 gave up
            time.sleep(0.05)
        return None
    t0 = time.monotonic()
    try:
        dist.barrier()
    except RuntimeError as exc:
        outcome = time.monotonic() - t0, str(exc)
    else:
        outcome = time.monotonic() - t0, "barrier passed"
    open(flag, "w").close()
    return outcome


def test_pg_timeout_bounds_a_collective_inside_the_rank(tmp_path):
    # Short (the test lasts it), but the ranks' start-up barrier runs under it too.
    results = run_ranks(_barrier_without_rank_0, 2, str(tmp_path / "gave-up"), pg_timeout=1.0, timeout=120)
    waited, message = results[1]
    assert "timed out" in message.lower() or "timeout" in message.lower(), message  # not "barrier passed"
    # The scaled timeout, not gloo's 30-minute default: the wait ended at it, not before.
    assert 1.0 <= results.pg_timeout <= waited < 1800, (results.pg_timeout, waited)


def test_guards_scale_with_the_measured_slowdown(monkeypatch):
    """A busy machine (here: a floor set through the environment) lengthens every guard."""
    monkeypatch.setenv("FSDP_FP8_TEST_SLOWDOWN", "3")
    results = run_ranks(_all_reduce_rank, 1, 0, timeout=7, pg_timeout=2)
    assert results.pg_timeout >= 6 and results.seconds["timeout"] >= 21, (results.pg_timeout, results.seconds)
    assert results.seconds["fail_grace"] >= 3 * FAIL_GRACE_S and results.seconds["lag_grace"] >= 3 * LAG_GRACE_S
    assert bound(10) >= 30


def test_a_busy_spell_keeps_bounds_loose_for_the_window(monkeypatch):
    """The largest factor of the last WINDOW_S is used: a bound derived just after a busy spell
    (a result measured then) is not judged by a quiet moment's factor."""
    import calibration

    readings = iter([4.0, 1.0, 1.0])
    monkeypatch.setattr(calibration, "measure", lambda: next(readings))
    monkeypatch.setattr(calibration, "REMEASURE_S", 0.0)
    monkeypatch.setattr(calibration, "_history", [])
    monkeypatch.delenv(calibration.ENV, raising=False)
    assert [calibration.slowdown() for _ in range(3)] == [4.0, 4.0, 4.0]
    monkeypatch.setattr(calibration, "_history", [(time.monotonic() - 2 * calibration.WINDOW_S, 4.0)])
    monkeypatch.setattr(calibration, "measure", lambda: 1.5)
    assert calibration.slowdown() == 1.5  # older than the window: forgotten
    monkeypatch.setenv(calibration.ENV, "fast")
    with pytest.raises(ValueError, match="FSDP_FP8_TEST_SLOWDOWN must be a number .* got 'fast'"):
        calibration.slowdown()


def test_pytest_timeout_is_scaled_by_the_slowdown(tmp_path):
    """The suite's conftest arms pytest-timeout with ``timeout x slowdown``: a test needing more
    than its reference-machine timeout passes on a machine that slow, and one that hangs is
    still stopped, at the scaled time."""
    import shutil
    import subprocess
    import sys

    here = os.path.dirname(os.path.dirname(__file__))  # tests/: the suite's own conftest
    for name in ("conftest.py", "calibration.py"):
        shutil.copy(os.path.join(here, name), tmp_path / name)
    (tmp_path / "test_slow.py").write_text(
        "import time, pytest\n"
        "@pytest.mark.timeout(0.5)\n"
        "def test_slower_than_its_reference_timeout():\n"
        "    time.sleep(1.0)\n"
        "@pytest.mark.timeout(0.5)\n"
        "def test_hangs():\n"
        "    time.sleep(3600)\n"
    )
    env = {**os.environ, "FSDP_FP8_TEST_SLOWDOWN": "3"}  # 1 s fits 3 x 0.5 s, not 0.5 s
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=bound(120),
    )
    out = proc.stdout
    assert "PASSED test_slow.py::test_slower_than_its_reference_timeout" in out, out
    assert "FAILED test_slow.py::test_hangs" in out, out
    scaled = float(re.search(r"Timeout \(>([0-9.]+)s\)", out).group(1))
    assert scaled >= 1.5, out
