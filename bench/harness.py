"""How the benchmarks start their processes and time them: one home for each pattern.

- Ranks in fresh processes: ``spawn_ranks`` runs a function on W spawned gloo ranks and returns
  what each returned; ``run_children`` starts one trial per rank in a fresh process and collects
  its result (or traceback, from ``run_rank_child``) through a pipe by one deadline.
- Jobs in this checkout: ``torchrun`` (``--standalone``, from the repository root), ``repo_env``.
- Orders: ``interleaved`` runs every method once per repetition, the order rotated, so a machine
  whose load drifts affects every method alike (``rotated`` is one repetition's order).
- Clocks: ``timed``, ``sample_seconds``, ``StepStamps`` (a pipeline's per-step stamps), ``Phases``
  (wall and CPU seconds per named phase), ``load_average``.

Rank processes leave through ``shutdown_distributed``: gloo + FSDP2 can abort an interpreter
that is finalizing (docs/shutdown.md).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOIN_S = 30.0  # run_children: how long a child that answered has to leave before it is killed


# --- ranks in fresh processes ----------------------------------------------------------------


def spawn_ranks(fn: Callable, world: int, *args, timeout: float = 3600.0) -> dict[int, object]:
    """``fn(rank, world, *args)`` on ``world`` fresh processes (spawn), one intra-op thread each,
    in one gloo group over a ``file://`` store when ``world > 1``; what each returned, by rank.
    ``fn`` is pickled by name: a module-level function."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="fsdp_fp8-bench-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_spawned_rank, args=(fn, r, world, store, args, queue)) for r in range(world)]
        for proc in procs:
            proc.start()
        results = dict(queue.get(timeout=timeout) for _ in procs)
        for proc in procs:
            proc.join(timeout=60)
    return results


def _spawned_rank(fn: Callable, rank: int, world: int, store: str, args: tuple, queue) -> None:
    import torch
    import torch.distributed as dist

    from fsdp_fp8.runtime.shutdown import shutdown_distributed

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    queue.put((rank, fn(rank, world, *args)))
    if world > 1:
        shutdown_distributed(0)  # not a finalizing exit: docs/shutdown.md


def file_store(prefix: str = "fsdp_fp8-bench-") -> str:
    """A ``file://`` URI for a process group's store, in a fresh temporary directory."""
    return (Path(tempfile.mkdtemp(prefix=prefix)) / "store").as_uri()


def run_children(ctx, children: Sequence[tuple[int, Callable, tuple]], timeout: float) -> list[dict]:
    """Each ``(rank, target, args)`` as ``target(*args, conn)`` in a fresh process of ``ctx``; each
    one's result through its pipe, in order, all by one deadline ``timeout`` seconds away. A child
    that says nothing by then, or ends without a word (killed, crashed), is ``{"rank", "error"}``.
    A silent child is killed at once (nothing it says later is read; its peers' teardown then
    fails fast instead of waiting for it); the others are joined, and killed after ``JOIN_S``."""
    pipes, procs = [], []
    for _, target, args in children:
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=target, args=(*args, writer))
        proc.start()
        writer.close()
        pipes.append(reader)
        procs.append(proc)
    deadline = time.monotonic() + timeout
    results = []
    for (rank, _, _), reader, proc in zip(children, pipes, procs):
        left = max(0.1, deadline - time.monotonic())
        try:
            if reader.poll(left):
                results.append(reader.recv())
            else:
                results.append({"rank": rank, "error": "timed out"})
                proc.kill()
        except EOFError:
            results.append({"rank": rank, "error": "the process ended without a result (killed or crashed)"})
    for proc in procs:
        proc.join(timeout=JOIN_S)
        if proc.is_alive():
            proc.kill()
    return results


def run_rank_child(rank: int, conn, trial: Callable[[], dict]) -> None:
    """A trial's rank, in its own process: ``trial()`` (which joins the process group) and send its
    result to the parent through ``conn``, or the traceback (``{"rank", "error"}``) if anything
    raised; then leave the group together and exit without interpreter finalization
    (docs/shutdown.md: gloo + FSDP2 can abort there)."""
    try:
        result = trial()
        import torch.distributed as dist

        conn.send(result)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        conn.send({"rank": rank, "error": traceback.format_exc()})
    conn.close()
    os._exit(0)


# --- jobs in this checkout -------------------------------------------------------------------


def repo_env(env: dict | None = None, **extra: str) -> dict[str, str]:
    """``env`` (default this process's) with ``extra`` set and the repository root first on
    ``PYTHONPATH``: a child imports ``bench`` and this checkout's ``fsdp_fp8`` from any directory."""
    out = dict(os.environ if env is None else env, **extra)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), out.get("PYTHONPATH")) if p)
    return out


def torchrun(ranks: int, *command: str, env: dict | None = None, timeout: float | None = None) -> tuple[int, str]:
    """``torchrun --standalone --nproc-per-node=ranks COMMAND`` from the repository root (COMMAND a
    script and its arguments, or ``-m``, a module and its arguments); its exit code and output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *command]
    proc = subprocess.run(cmd, env=repo_env(env), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr


# --- orders ----------------------------------------------------------------------------------


def rotated(items: Sequence, rep: int) -> list:
    """``items`` starting at ``rep`` (modulo their number): repetition ``rep``'s order."""
    k = rep % len(items)
    return [*items[k:], *items[:k]]


def interleaved(names: Iterable, reps: int) -> Iterator[tuple[int, object]]:
    """``(rep, name)`` for every name in each of ``reps`` repetitions, the order rotated by one
    each repetition: no name always runs first, on a cold machine, or after the same neighbour."""
    names = list(names)
    for rep in range(reps):
        for name in rotated(names, rep):
            yield rep, name


# --- clocks ----------------------------------------------------------------------------------


def timed(fn: Callable, *, after: Callable | None = None) -> tuple[float, object]:
    """(wall seconds, result) of ``fn()``; ``after()`` (a device sync) runs inside the timing."""
    t0 = time.perf_counter()
    out = fn()
    if after is not None:
        after()
    return time.perf_counter() - t0, out


def sample_seconds(
    fn: Callable, n: int, *, before: Callable | None = None, after: Callable | None = None
) -> list[float]:
    """Wall seconds of ``n`` calls of ``fn``: ``before()`` (a barrier, a sync) outside each one's
    timing, ``after()`` inside it."""
    out = []
    for _ in range(n):
        if before is not None:
            before()
        out.append(timed(fn, after=after)[0])
    return out


class StepStamps:
    """A diffusers pipeline's ``callback_on_step_end`` that stamps the end of every step."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, _pipe, _step, _timestep, _kwargs) -> dict:
        self.stamps.append(time.perf_counter())
        return {}

    def since(self, start: float) -> float:
        """Seconds from ``start`` to the last step's end: the denoising loop, without the decode."""
        return self.stamps[-1] - start

    def steps(self) -> list[float]:
        """Seconds of steps 1 .. n-1 (step 0 has no stamp before it; it pays the first call)."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


class Phases:
    """Wall seconds per named phase on this rank (a phase entered twice adds up), and the
    process's CPU seconds in it (every thread: a reader's workers and the prefetch too)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name: str):
        t, c = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t
            self.cpu[name] += time.process_time() - c

    def run(self, name: str, fn: Callable):
        """``fn()`` timed as phase ``name``; its result."""
        with self(name):
            return fn()

    def wrap(self, name: str, fn: Callable) -> Callable:
        """``fn`` timed as phase ``name`` at every call."""

        def timed_call(*args, **kwargs):
            with self(name):
                return fn(*args, **kwargs)

        timed_call.__wrapped__ = fn
        return timed_call


def load_average() -> str:
    """The 1, 5 and 15 minute load averages: how quiet the machine was."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())
