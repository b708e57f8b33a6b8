"""A small multi-rank test harness: run a function on N gloo ranks in fresh processes.

PyTorch's ``FSDPTest`` skips on CPU and ``torch.testing._internal`` is private, so the
distributed tests use this instead::

    from ranks import run_ranks

    def _check(rank, world_size, rows):      # module level: spawn imports it by name
        ...
        return something_picklable

    def test_something():
        results = run_ranks(_check, 3, 7)     # [rank 0's return, rank 1's, rank 2's]

Each rank joins a gloo process group through a ``file://`` store in a fresh temporary
directory, so there is no port to collide on. Results are judged, not only exit codes:
each rank sends its return value (or its traceback) through its own pipe *before* it
tears down, and a rank that delivered its result and then died at interpreter exit
counts as a success (its exit code is kept in ``results.exitcodes``). See docs/shutdown.md
for why such late deaths happen with FSDP2 + gloo on CPU.

Ranks start from a fork server (``multiprocessing``'s "forkserver", one per test process) that
imported torch, torchao, fsdp_fp8 and diffusers' Cosmos 3 pipelines once (``PRELOAD``), not each
as a fresh interpreter that imports them again (4.1 CPU-s per rank for torch alone, measured on a
2-core machine). A rank is still a new process:
it gets the test's environment and its stdout / stderr (sent along and set first: a fork server
keeps the ones it started with), imports the test module by name, makes its own process group,
and runs its ``atexit`` handlers when it ends. A forked process leaves through ``os._exit``, so
the rest of the interpreter's teardown does not run; the shutdown tests use real ``torchrun``
processes for that. What the preloaded modules read from the environment at import time was read
once, in the server: a test that sets such a variable (``TORCH_LOGS``, say) for its ranks needs
``FSDP_FP8_TEST_SPAWN=1``, which starts every rank as a fresh interpreter instead.

Nothing can hang: the whole run is bounded by ``timeout``; once one rank fails, or once
every other rank has finished, stragglers get a few seconds (``FAIL_GRACE_S``,
``LAG_GRACE_S``) and are then killed. A straggler stopped by a signal (SIGSTOP: the heartbeat
tests stop ranks on purpose) cannot report at all, so once a rank has failed it is killed at
once. ``pg_timeout`` (seconds) is passed to ``init_process_group``, so a collective waiting
on a peer that never arrives raises inside the rank after that long instead of at gloo's
30-minute default: the tests that check how the library reports such a hang use it, the way a
launcher should set its own timeout.

Every one of these durations is a reference-machine figure multiplied by
``calibration.slowdown()`` (tests/calibration.py): on a busy machine the guards wait
proportionally longer instead of failing a run that is merely slow. The factor is measured
when the run starts and again while it waits (a machine getting busier moves the deadline
out); the durations used are in ``results.seconds`` and in every timeout message.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib
import importlib.util
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from calibration import REMEASURE_S, slowdown

# Once a rank fails, the others get this long to report their own failure (gloo notices a
# dead peer at once, so they usually do) before they are killed.
FAIL_GRACE_S = 3.0
# Once a rank has finished, the stragglers get this long after the latest finish; a rank
# that really hangs while the others are done is killed then, not at the overall timeout.
LAG_GRACE_S = 10.0
# How often the ranks are looked at during a failure's grace (for one stopped by a signal).
POLL_S = 0.1


# What the fork server imports before it forks ranks: what nearly every rank function imports,
# then what a pipeline rank imports on its first load (diffusers' Cosmos 3 pipelines and VAE,
# transformers' tokenizers, the launcher): 1.7 CPU-s a rank, measured on a 2-core machine. The
# tests that fsdp_fp8 alone imports neither transformers nor diffusers run fresh interpreters.
# A name that does not import (diffusers absent) is skipped by the fork server.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torchao", "fsdp_fp8", "fsdp_fp8.compose.model"]
PRELOAD += [
    "diffusers.pipelines.cosmos.pipeline_cosmos3_omni",
    "diffusers.modular_pipelines.cosmos",
    "diffusers.models.autoencoders.autoencoder_kl_wan",
    "transformers",
    "fsdp_fp8.cli.runner",
    "fsdp_fp8.compose.pipeline",
    "fsdp_fp8.generation.engine",
]
SPAWN_ENV = "FSDP_FP8_TEST_SPAWN"


def _rank_context():
    """The start method ranks use: the preloaded fork server (``spawn`` with SPAWN_ENV=1)."""
    if os.environ.get(SPAWN_ENV) == "1" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")  # one context per process; the preload takes effect at its first start
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class RanksFailed(AssertionError):
    """One or more ranks raised, died before returning, hung, or the run timed out."""


class RankResults(list):
    """Per-rank return values in rank order; ``exitcodes`` holds each process's exit code.

    A non-zero exit code next to a delivered result means the rank died *after* returning
    (e.g. an abort at interpreter exit); the result is still trusted.
    """

    exitcodes: list[int | None]
    late_deaths: dict[int, str]
    pg_timeout: float | None  # the process group's timeout the ranks ran with (scaled)
    seconds: dict[str, float]  # the scaled timeout and graces the run was judged by


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
              pg_timeout: float | None = None, **kwargs: Any) -> RankResults:  # fmt: skip
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    Returns every rank's return value in rank order, or raises ``RanksFailed`` with the
    traceback of every rank that raised and the fate of every rank that died or hung.
    ``fn`` must be a module-level function; its return value must be picklable.
    ``pg_timeout``: the process group's timeout in seconds (None: torch's default).
    ``timeout``, ``pg_timeout`` and the graces are reference-machine seconds, scaled by
    ``calibration.slowdown()``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    fn_ref = (fn.__module__, fn.__qualname__, getattr(sys.modules.get(fn.__module__), "__file__", None))
    store_dir = tempfile.mkdtemp(prefix="fsdp_fp8-ranks-")
    init_method = Path(store_dir, "store").as_uri()
    ctx = _rank_context()
    forked = _Forked() if ctx.get_start_method() == "forkserver" else None
    factor = slowdown()
    if pg_timeout is not None:
        pg_timeout = pg_timeout * factor
    procs: list[mp.process.BaseProcess] = []
    readers: list[mp_connection.Connection] = []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child,
                args=(rank, world_size, init_method, fn_ref, args, kwargs, writer, pg_timeout, forked),
                name=f"rank{rank}",
                daemon=True,
            )
            proc.start()
            writer.close()  # the child holds the only writer: EOF then means it is gone
            procs.append(proc)
            readers.append(reader)
        results = _collect(procs, readers, timeout, factor)
        results.pg_timeout = pg_timeout
        return results
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=FAIL_GRACE_S)
        for reader in readers:
            reader.close()
        shutil.rmtree(store_dir, ignore_errors=True)


def _tenths_down(seconds: float) -> str:
    """``seconds`` to a tenth, rounded down: a message never states a longer wait than the one made
    (9.56 s waited reads "9.5", not "9.6", which a test comparing it with the clock would refuse)."""
    return f"{math.floor(seconds * 10) / 10:.1f}"


def _collect(procs, readers, timeout: float, factor: float) -> RankResults:
    world_size = len(procs)
    start = time.monotonic()
    messages: dict[int, tuple[str, Any]] = {}  # rank -> ("ok", value) | ("error", traceback)
    teardown: dict[int, str] = {}  # rank -> traceback of a failed teardown after its result
    exited: dict[int, int | None] = {}
    eof: set[int] = set()
    first_failure: float | None = None
    last_finish: float | None = None

    def drain(rank: int) -> None:
        while rank not in eof and readers[rank].poll(0):
            try:
                kind, payload = readers[rank].recv()
            except (EOFError, OSError):  # died before or while sending
                eof.add(rank)
                return
            if kind == "ok":
                payload = _from_bytes(payload)
            if kind == "teardown":
                teardown[rank] = payload
            else:
                messages[rank] = (kind, payload)

    stopped = ""
    while len(exited) < world_size:
        now = time.monotonic()
        factor = max(factor, slowdown())  # re-measured every REMEASURE_S: a busier machine waits longer
        deadline = start + timeout * factor
        fail_grace, lag_grace = FAIL_GRACE_S * factor, LAG_GRACE_S * factor
        finished = {r for r in range(world_size) if r in messages or r in exited}
        failed = {r for r in finished if r not in messages or messages[r][0] == "error"}
        if failed and first_failure is None:
            first_failure = now
        stop_at = deadline
        if first_failure is not None:
            stop_at = min(stop_at, first_failure + fail_grace)
        if last_finish is not None:
            stop_at = min(stop_at, last_finish + lag_grace)
        running = [r for r in range(world_size) if r not in finished]
        # A rank stopped by a signal (SIGSTOP) cannot report until something continues it, and
        # nothing in a run does: once another rank has failed, its grace would only be waited out.
        frozen = first_failure is not None and bool(running) and all(_stopped(procs[r].pid) for r in running)
        if now >= stop_at or frozen:
            scaled = f" ({{:g}} s on the reference machine x slowdown {factor:.2f}, tests/calibration.py)"
            stopped = (
                "it was stopped by a signal (state T) when another rank failed, so it could not report"
                if frozen and now < stop_at
                else f"the run timed out after {_tenths_down(timeout * factor)} s" + scaled.format(timeout)
                if now >= deadline
                else f"it was still running {_tenths_down(fail_grace)} s after another rank failed"
                + scaled.format(FAIL_GRACE_S)
                if first_failure is not None
                else f"it was still running {_tenths_down(lag_grace)} s after the last other rank finished"
                + scaled.format(LAG_GRACE_S)
            )
            break
        waitables: dict[Any, tuple[str, int]] = {}
        for rank in range(world_size):
            if rank not in exited:
                waitables[procs[rank].sentinel] = ("exit", rank)
            if rank not in eof and rank not in messages:
                waitables[readers[rank]] = ("message", rank)
        # During a failure's grace, look again every POLL_S: a rank can stop meanwhile.
        poll = POLL_S if first_failure is not None else REMEASURE_S
        for ready in mp_connection.wait(list(waitables), timeout=min(stop_at - now, REMEASURE_S, poll)):
            what, rank = waitables[ready]
            if what == "exit":
                procs[rank].join()
                exited[rank] = procs[rank].exitcode
            drain(rank)  # after an exit too: its result may still sit in the pipe
        if {r for r in range(world_size) if r in messages or r in exited} != finished:
            last_finish = time.monotonic()

    killed = {rank for rank in range(world_size) if rank not in exited}
    for rank in sorted(killed):
        procs[rank].kill()
        procs[rank].join(timeout=FAIL_GRACE_S)
        exited[rank] = procs[rank].exitcode
        drain(rank)

    problems = []
    for rank in range(world_size):
        kind, payload = messages.get(rank, (None, None))
        if kind == "error":
            problems.append(f"rank {rank} raised:\n{payload}")
        elif kind is None and rank in killed:
            problems.append(f"rank {rank} returned no result and was killed: {stopped}")
        elif kind is None:
            problems.append(f"rank {rank} {_describe_exit(exited[rank])} before returning a result")
    if problems:
        raise RanksFailed(f"{len(problems)} of {world_size} ranks failed:\n\n" + "\n\n".join(problems))

    results = RankResults(messages[rank][1] for rank in range(world_size))
    results.exitcodes = [exited[rank] for rank in range(world_size)]
    results.seconds = {"timeout": timeout * factor, "fail_grace": fail_grace, "lag_grace": lag_grace}
    results.late_deaths = {
        rank: f"{_describe_exit(code)} after delivering its result"
        + (f"; teardown failed:\n{teardown[rank]}" if rank in teardown else "")
        for rank, code in enumerate(results.exitcodes)
        if code != 0 or rank in teardown
    }
    return results


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal (SIGSTOP, SIGTSTP: state "T" in /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[:1] == ["T"]
    except OSError:  # gone, or no /proc: not known to be stopped
        return False


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"died of {name}"
    return f"exited with code {code}"


def _resolve(module: str, qualname: str, filename: str | None) -> Callable[..., Any]:
    """Find ``fn`` in the child: by module name, else from its file.

    Test modules are imported by pytest under a name that depends on its import mode
    (``test_x`` with rootdir-relative sys.path entries, something unimportable under
    ``importlib`` mode); the file path always works.
    """
    try:
        mod = importlib.import_module(module) if module != "__main__" else sys.modules["__mp_main__"]
    except ImportError:
        if filename is None:
            raise
        spec = importlib.util.spec_from_file_location(module, filename)
        assert spec is not None and spec.loader is not None, filename
        mod = importlib.util.module_from_spec(spec)
        sys.modules[module] = mod
        spec.loader.exec_module(mod)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class _Forked:
    """What a rank forked from the server needs from the test process, as it is at the start:
    its environment, and its stdout and stderr (pytest's capture; the server has the ones it
    started with). The descriptors travel with the rank's arguments (``DupFd``)."""

    def __init__(self):
        self.env = dict(os.environ)

    def __reduce__(self):
        from multiprocessing.reduction import DupFd

        return (_attach, (self.env, DupFd(1), DupFd(2)))


def _attach(env: dict[str, str], out, err) -> tuple[dict[str, str], int, int]:
    return env, out.detach(), err.detach()


def _child(rank, world_size, init_method, fn_ref, args, kwargs, conn, pg_timeout=None, forked=None) -> None:
    if forked is not None:  # the test's environment and streams, not the fork server's
        env, out, err = forked
        os.environ.clear()
        os.environ.update(env)
        for fd, std in ((out, 1), (err, 2)):
            os.dup2(fd, std)
            os.close(fd)
    # A segfault or a hang dump then shows a Python stack in the test's captured stderr.
    faulthandler.enable()
    import torch.distributed as dist

    try:
        fn = _resolve(*fn_ref)
        extra = {} if pg_timeout is None else {"timeout": timedelta(seconds=pg_timeout)}
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, **extra)
        # gloo's connectFullMesh can finish on one rank while a peer, slowed by a busy machine, still
        # reads its side of a connection: a rank whose function returns at once and exits would then
        # close that connection under the peer ("Connection closed by peer", seen beside busy
        # processes). Every rank leaves the start-up together, before the test's function runs.
        dist.barrier()
        result = fn(rank, world_size, *args, **kwargs)
        # Bytes from torch.save, not multiprocessing's pickling: its tensor reduction shares
        # storage through file descriptors that vanish when this process exits before the
        # parent reads them, and plain pickle cannot carry float8 tensors (torch 2.13).
        conn.send(("ok", _to_bytes(result)))  # before teardown: a crash at exit must not lose it
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent as text
        _send_quietly(conn, ("error", traceback.format_exc()))
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001
        _send_quietly(conn, ("teardown", traceback.format_exc()))
    conn.close()
    if forked is not None:
        # A forked process ends in os._exit, past the interpreter's exit: run the exit handlers
        # (what a spawned rank, or a torchrun rank, runs when it exits) here instead. Unlike at a
        # real exit, non-daemon threads have not been joined yet.
        atexit._run_exitfuncs()


def _to_bytes(obj) -> bytes:
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes):
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def _send_quietly(conn, message) -> None:
    try:
        conn.send(message)
    except Exception:  # noqa: BLE001 - the parent then reports the missing result
        pass
