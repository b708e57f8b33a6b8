"""launch/infer.py end to end in subprocesses: torchrun at 2 ranks equals 1 process, bit for bit."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from calibration import bound

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path, cache, *args, nproc=None, timeout=240):
    env = {**os.environ, "FSDP_FP8_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable]
    if nproc is not None:
        # --standalone: a rendezvous on a free local port, never a fixed one.
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    report = tmp_path / f"report-{nproc}.json"
    cmd += [str(ROOT / "launch" / "infer.py"), "--report", str(report), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=bound(timeout))
    return proc, (json.loads(report.read_text()) if report.exists() else None)


@pytest.fixture(scope="module")
def cache(demo_cache):
    return demo_cache


def test_two_ranks_give_the_single_process_outputs_prompt_by_prompt(tmp_path, cache):
    from PIL import Image

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\n\na lighthouse in a storm\na bowl of ramen\n")  # 3 prompts, a blank line
    outputs = {}
    for nproc in (None, 2):
        out = tmp_path / f"out-{nproc}" / "image.png"
        out.parent.mkdir()
        proc, report = _run(
            tmp_path, cache, "--steps", "8", "--prompts", str(prompts), "--output", str(out), nproc=nproc
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs[nproc] = (proc, report, sorted(out.parent.iterdir()))
    (_, one, files_1), (double, two, files_2) = outputs[None], outputs[2]
    assert two["world_size"] == 2 and one["world_size"] == 1
    # Rank 0 made prompts 0 and 2, rank 1 prompt 1 (and one padding request).
    assert [r["rank"] for r in two["outputs"]] == [0, 1, 0] and [r["index"] for r in two["outputs"]] == [0, 1, 2]
    assert [r["latent_sha256"] for r in two["outputs"]] == [r["latent_sha256"] for r in one["outputs"]]
    assert len({r["latent_sha256"] for r in one["outputs"]}) == 3  # three different prompts
    assert [f.name for f in files_2] == ["image-000.png", "image-001.png", "image-002.png"]
    for a, b in zip(files_1, files_2):
        assert a.read_bytes() == b.read_bytes()
        with Image.open(b) as image:  # a file an image reader opens
            assert image.format == "PNG" and image.size == (32, 32)
    assert two["latent_sha256"] in double.stdout  # the table shows it too
    # The demo's published first/last-3 policy, per step, for every prompt.
    assert {r["precision_trace"] for r in two["outputs"]} == {"W8A16 x3 / W8A8 x2 / W8A16 x3"}
    # Each rank holds and reads about half of the single process's bytes.
    assert sum(r["bytes_held"] for r in two["ranks"]) <= one["ranks"][0]["bytes_held"] * 1.05
    assert all(r["bytes_read"] < 0.6 * one["ranks"][0]["bytes_read"] for r in two["ranks"])


def test_step_policy_off_runs_every_step_w8a8_and_changes_the_result(tmp_path, cache, monkeypatch, caplog):
    """In process (one process, no group): the same 4 steps with the checkpoint's policy (all
    four inside its first/last-3 windows: W8A16) and with it off (W8A8)."""
    from fsdp_fp8.cli.runner import main

    monkeypatch.setenv("FSDP_FP8_CACHE", str(cache))
    reports = {}
    for policy in ("auto", "off"):
        path = tmp_path / f"{policy}.json"
        with caplog.at_level("WARNING", logger="fsdp_fp8"):
            assert main(["--steps", "4", "--step-policy", policy, "--report", str(path)]) == 0
        reports[policy] = json.loads(path.read_text())
    assert reports["auto"]["precision_trace"] == "W8A16 x4"
    assert reports["off"]["precision_trace"] == "W8A8 x4"
    assert reports["off"]["latent_sha256"] != reports["auto"]["latent_sha256"]
    assert "disabled by override 'off'" in caplog.text


@pytest.mark.parametrize("case", ["missing", "pickles"])
def test_a_checkpoint_that_is_not_there_is_one_line_from_rank_0_under_plain_torchrun(tmp_path, cache, case):
    """The README's plain torchrun: a path that names no checkpoint is a usage error of the parse
    step on every rank (exit 2, before torch: the failure table shows it), printed by rank 0
    alone, naming no source line of ours (torchrun then adds its own report)."""
    bad = tmp_path / "not-a-checkpoint"
    if case == "pickles":
        bad.mkdir()
        (bad / "pytorch_model.bin").write_bytes(b"not really a pickle")
    proc, report = _run(tmp_path, cache, "--checkpoint", str(bad), nproc=2)
    assert proc.returncode != 0 and report is None
    ours = [line for line in proc.stderr.splitlines() if "error" in line and "not-a-checkpoint" in line]
    needle = "does not exist" if case == "missing" else "only pickle checkpoint files ['pytorch_model.bin']"
    assert len(ours) == 1 and ours[0].startswith("launch/infer.py: error: --checkpoint: "), proc.stderr[-3000:]
    assert needle in ours[0], ours
    assert "exitcode  : 2" in proc.stderr  # torchrun's table: the parse step's usage error, not a load's 1
    assert "raised at" not in proc.stderr and "fsdp_fp8/" not in proc.stderr, proc.stderr[-3000:]


def test_a_usage_error_only_rank_1_meets_is_printed_once_by_rank_1(tmp_path):
    """A --prompts file rank 1's node lacks (each rank reads a relative path from a directory of
    its own): rank 0 parses cleanly and waits in the rendezvous, rank 1 names the file and itself.
    Rank 0 then ends on torchrun's SIGTERM (143), not on its SIGKILL 30 s later: a signal in the
    rendezvous's native wait is seen by a thread (``interrupts.ended_in_native_wait``)."""
    for rank in (0, 1):
        (tmp_path / f"node{rank}").mkdir()
    (tmp_path / "node0" / "prompts.txt").write_text("a red fox\n")
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys\n"
        "os.chdir(os.path.join(sys.argv[1], 'node' + os.environ['RANK']))\n"
        "from fsdp_fp8.cli.commands import main\n"
        "sys.exit(main(['run', '--prompts', 'prompts.txt'], prog='launch/infer.py'))\n"
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([*cmd, str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    ours = [line for line in proc.stderr.splitlines() if "prompts.txt" in line]
    assert ours == ["launch/infer.py: error (rank 1; rank 0 did not meet it): --prompts prompts.txt: no such file"], (
        proc.stderr[-3000:]
    )
    assert "usage:" not in proc.stderr, proc.stderr[-3000:]
    # torchrun's table: rank 0's status is its own 128 + SIGTERM, not -9 (SIGKILL)
    assert "exitcode  : 143 (pid" in proc.stderr and "SIGKILL" not in proc.stderr, proc.stderr[-3000:]


# --- clean failures at 2 ranks: one line per problem, once; the exit status says which kind ----


def _spawn(*args, timeout=240, **popen):
    """``launch/infer.py --nproc-per-node 2 ARGS``: the launcher starts its own two ranks."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("FSDP_FP8_TRACEBACK", None)
    env.update(popen.pop("env", {}))
    cmd = [sys.executable, str(ROOT / "launch" / "infer.py"), "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_failure_at_two_ranks_is_its_error_lines_and_nothing_else(tmp_path):
    bad = tmp_path / "not-a-checkpoint"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\x00" * 4)  # a checkpoint by its name, refused by its bytes
    proc = _spawn("--checkpoint", str(bad))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"error: cannot load {bad}: 1 problem:",
        "  - all 2 ranks: model.safetensors: truncated: 4 bytes, too short for the 8-byte header length",
    ]
    assert proc.stdout == ""


def test_a_usage_error_at_two_ranks_is_printed_once_and_exits_2(tmp_path):
    proc = _spawn("--steps", "0")  # refused before any rank starts
    assert proc.returncode == 2 and proc.stderr.count("usage:") == 1, proc.stderr
    assert proc.stderr.splitlines()[-1] == "launch/infer.py: error: --steps must be >= 1, got 0"
    # Plain torchrun: each rank parses; rank 0 alone prints (torchrun then adds its own summary).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(ROOT / "launch" / "infer.py"), "--steps", "0"]
    plain = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert plain.returncode != 0 and plain.stderr.count("usage: launch/infer.py") == 1, plain.stderr[-3000:]
    assert plain.stderr.count("error: --steps must be >= 1, got 0") == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--timeout", "inf"], "--timeout must be <= 86,400 seconds (a day), got inf"),
        (["--height", "33", "--width", "32"], "--height 33 is not a multiple of 4 (`scale_factor_spatial` 4 in the "
         "demo's VAE): use 32 or 36"),
        (["--output", "same.png", "--report", "same.png"], "--report same.png and --output same.png are the same file"),
    ],
)  # fmt: skip
def test_careless_input_is_one_usage_error_under_both_launchers(tmp_path, argv, message):
    """Under the launcher's --nproc-per-node 2 (exit 2, nothing else printed) and under plain
    torchrun (rank 0 alone prints it; every rank's exit status is the usage error's 2)."""
    launcher = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "infer.py"), "--nproc-per-node", "2", *argv],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert launcher.returncode == 2 and launcher.stderr.splitlines()[-1].startswith("launch/infer.py: error: ")
    assert message in launcher.stderr and launcher.stderr.count("error:") == 1, launcher.stderr
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    plain = subprocess.run(
        [*cmd, str(ROOT / "launch" / "infer.py"), *argv], cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert plain.stderr.count(f"launch/infer.py: error: {message}") == 1, plain.stderr[-3000:]
    assert "exitcode  : 2" in plain.stderr and "Traceback" not in plain.stderr.split("error:")[0]
    assert not (tmp_path / "same.png").exists()


@pytest.mark.parametrize("signum, name", [(2, "SIGINT"), (15, "SIGTERM")])
def test_a_signal_ends_every_rank_with_one_line(tmp_path, cache, signum, name):
    """Ctrl-C sends SIGINT to the whole job (the launcher and both ranks); SIGTERM to the
    launcher alone is passed on to the ranks by torch's agent."""
    import signal
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1", "FSDP_FP8_CACHE": str(cache)}
    cmd = [sys.executable, str(ROOT / "launch" / "infer.py"), "--nproc-per-node", "2", "--steps", "5000"]
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        deadline = time.monotonic() + 240  # a hang guard: the demo may have to be built first
        while "step 2/5000" not in err_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-3000:]
            time.sleep(0.2)
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)  # what a terminal's Ctrl-C does
        else:
            proc.send_signal(signum)
        code = proc.wait(timeout=120)
    stderr = err_path.read_text()
    assert code == 128 + signum, stderr[-3000:]
    tail = [line for line in stderr.splitlines() if not line.startswith("[fsdp_fp8] ")]
    assert tail == [f"error: stopped by {name}"], stderr[-3000:]


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the launcher's child that runs ``rank`` (its environment says which)."""
    for entry in os.listdir("/proc"):
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            parent = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]
        except (OSError, IndexError):
            continue
        if parent == str(launcher) and f"RANK={rank}".encode() in environ:
            return int(entry)
    return None


def test_a_rank_killed_mid_loop_under_cfg_parallel_is_named(tmp_path, cache):
    """Rank 1 killed (SIGKILL) during generation under the launcher's own --nproc-per-node 2 and
    --cfg-parallel: the survivor names it (was only `error: stopped by SIGTERM`). Without
    --cfg-parallel the same holds (tests/distributed/test_heartbeat.py holds the mechanism)."""
    import signal
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1", "FSDP_FP8_CACHE": str(cache)}
    cmd = [sys.executable, str(ROOT / "launch" / "infer.py"), "--nproc-per-node", "2", "--steps", "5000"]
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([*cmd, "--cfg-parallel"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err)
        try:
            deadline = time.monotonic() + 240  # a hang guard: the demo may have to be built first
            while "step 2/5000" not in err_path.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-3000:]
                time.sleep(0.2)
            victim = _rank_pid(proc.pid, 1)
            os.kill(victim, signal.SIGKILL)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stderr = err_path.read_text()
    assert code == 128 + signal.SIGKILL, stderr[-3000:]  # the first failed rank's own status
    tail = [line for line in stderr.splitlines() if not line.startswith("[fsdp_fp8] ")]
    # rank 0's own line, or its heartbeat's when its main thread was blocked in the backend
    assert len(tail) == 1 and tail[0].split(": ", 1)[0] in ("error", "error (rank 0)"), tail
    assert (
        tail[0]
        .split(": ", 1)[1]
        .startswith(
            f"rank 1 (host {socket.gethostname()}, pid {victim}) ended "
            "during the pipeline's load or generation: its process is gone"
        )
    ), tail


def test_a_run_prints_no_third_party_noise(tmp_path):
    """Every stderr line of a run that builds the demo (diffusers' float32 notice), loads a
    pipeline (its accelerate advice) and imports TorchAO (its kernel warnings) is our own."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "infer.py"), "--steps", "1"],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "FSDP_FP8_CACHE": str(tmp_path / "fresh-cache")},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line for line in proc.stderr.splitlines() if not line.startswith("[fsdp_fp8] ")] == []
