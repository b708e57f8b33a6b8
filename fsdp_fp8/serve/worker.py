"""Every rank's serving loop: rank 0 hands out rounds, every rank runs them on the engine.

    rank 0: the HTTP thread queues jobs (serve.jobs); this loop, at most every POLL_S:
            the next round = the oldest queued job and the queued jobs that can share its round
            (as many steps, guidance on or off alike: as many transformer forwards), one per
            request group
    every rank: the command, broadcast from rank 0 over the gloo agreement group
            (idle, a round with its jobs' values and uploads, or stop)
            -> Engine.run_round: the request groups run their jobs at once, the step meetings
               carry progress to rank 0 and rank 0's cancels to every rank (generation.meetings)
    rank 0: the results into the records; a job stopped only by another's failure runs again

The commands travel over the process group the load made (no other transport). A lost rank ends
the loop on every rank that sees it (``PeerLostError``): rank 0 fails the unfinished jobs naming
it, keeps answering ``/health`` with 503 for ``LOST_GRACE_S``, and every process exits non-zero.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from fsdp_fp8.collective import distributed, rank_and_world
from fsdp_fp8.collective.group import side_group
from fsdp_fp8.errors import ArgumentError, PeerLostError
from fsdp_fp8.generation.engine import STOPPED_WITH_ROUND, Engine, Observer, Task, round_key
from fsdp_fp8.generation.results import CANCELLED, COMPLETED, TaskResult
from fsdp_fp8.generation.values import GenerationRequest, Prompt
from fsdp_fp8.serve import jobs as job_states
from fsdp_fp8.serve.jobs import JobRecord, JobStore

log = logging.getLogger("fsdp_fp8")

POLL_S = 0.5  # rank 0 waits this long for a job before telling the ranks it is idle
LOST_GRACE_S = 5.0  # after a lost rank, /health answers 503 this long before the process exits
MAX_ATTEMPTS = 3  # a job stopped by other jobs' failures runs again, this many times in all
IDLE, ROUND, STOP = "idle", "round", "stop"


@dataclass(frozen=True)
class JobSpec:
    """What every rank needs of one job: its values, its upload's bytes, its raw actions' bytes
    (a ``.json`` file), its output's name."""

    id: str
    request: GenerationRequest
    prompt: Prompt
    output_name: str
    upload: bytes | None = None
    upload_suffix: str = ""
    upload_kind: str | None = None
    actions: bytes | None = None


@dataclass(frozen=True)
class Command:
    kind: str
    jobs: tuple[JobSpec, ...] = ()


@dataclass
class ServerState:
    """What the HTTP side reports of the ranks: loaded, lost (why), draining (since when)."""

    ready: bool = False
    lost: str | None = None
    draining_since: float | None = None
    stopped: threading.Event = None  # set when the loop has ended

    def __post_init__(self) -> None:
        self.stopped = threading.Event()


def same_round(a: JobRecord, b: JobRecord) -> bool:
    """Whether two jobs can share a round (``generation.engine.round_key``: the same transformer calls)."""
    return _round_key(a) == _round_key(b)


def _round_key(record: JobRecord) -> tuple:
    keys = ("steps", "guidance", "sound", "action")
    return round_key(GenerationRequest(**{k: record.request[k] for k in keys if k in record.request}))


class StoreObserver(Observer):
    """Rank 0's: every request's step into its record; the cancels asked (and, past the drain's
    grace, every running job) back to the ranks."""

    def __init__(self, store: JobStore, state: ServerState, drain_s: float) -> None:
        self.store, self.state, self.drain_s = store, state, drain_s
        self.running: frozenset[str] = frozenset()

    def on_step(self, key: str, index: int, step: int, steps: int) -> None:
        self.store.update(key, progress=2 + (93 * step) // steps, phase=f"step {step}/{steps}", steps_run=step)

    def cancelled(self) -> frozenset[str]:
        since = self.state.draining_since
        if since is not None and time.monotonic() - since > self.drain_s:
            return self.running
        return self.store.cancelled_running()


class Worker:
    """One rank's loop. ``store``, ``state``: rank 0's (None elsewhere)."""

    def __init__(self, engine: Engine, output_dir: Path, timeout_s: float, store=None, state=None, drain_s=30.0):
        self.engine, self.output_dir, self.timeout_s = engine, Path(output_dir), timeout_s
        self.store, self.state = store, state
        self.rank = rank_and_world()[0]
        self.observer = StoreObserver(store, state, drain_s) if store is not None else Observer()
        self.uploads = Path(tempfile.mkdtemp(prefix=f"fsdp_fp8-serve-rank{self.rank}-"))

    def run(self) -> None:
        """Until rank 0 says stop (collective; a lost rank raises ``PeerLostError``)."""
        while True:
            command = self._broadcast(self._next_command() if self.rank == 0 else None)
            if self.state is not None:
                self.state.ready = True  # every rank has loaded and answered
            if command.kind == STOP:
                return
            if command.kind == ROUND:
                self._run_round(command.jobs)

    def _next_command(self) -> Command:
        state, store = self.state, self.store
        if state.draining_since is not None:
            store.drop_queued("the server is stopping (SIGTERM)")
            return Command(STOP)
        with store.lock:
            if not store.queue:
                store.changed.wait(POLL_S)
        taken = store.take(self.engine.layout.requests, same_round)
        return Command(ROUND, tuple(self._spec(r) for r in taken)) if taken else Command(IDLE)

    def _spec(self, record: JobRecord) -> JobSpec:
        upload = self.output_dir / "uploads" / record.upload if record.upload else None
        actions = self.output_dir / "uploads" / record.actions_upload if record.actions_upload else None
        return JobSpec(
            id=record.id,
            request=GenerationRequest(**{k: tuple(v) if isinstance(v, list) else v for k, v in record.request.items()}),
            prompt=Prompt(record.prompt, record.request.get("negative_prompt"), seed=record.request["seed"]),
            output_name=record.output,
            upload=upload.read_bytes() if upload is not None else None,
            upload_suffix=upload.suffix if upload is not None else "",
            upload_kind=record.upload_kind,
            actions=actions.read_bytes() if actions is not None else None,
        )

    def _broadcast(self, command: Command | None) -> Command:
        if not distributed():
            return command
        box = [command]
        try:
            dist.broadcast_object_list(box, src=0, group=side_group(self.timeout_s, "serving"))
        except Exception as exc:  # a peer died or stopped answering
            raise PeerLostError(f"rank {self.rank} lost its peers while serving: {type(exc).__name__}: {exc}") from exc
        return box[0]

    def _run_round(self, specs: tuple[JobSpec, ...]) -> None:
        tasks = [self._task(index, spec) for index, spec in enumerate(specs)]
        self.observer.running = frozenset(spec.id for spec in specs)
        try:
            results = self.engine.run_round(tasks, self.observer)
        except ArgumentError as exc:  # the round refused before any call, alike on every rank: its jobs fail
            results = []
            if self.store is not None:
                for spec in specs:
                    message = "; ".join(exc.problems)
                    self.store.finish(spec.id, job_states.FAILED, error={"code": "invalid_request", "message": message})
        finally:
            for path in self.uploads.iterdir():
                path.unlink(missing_ok=True)
        if self.store is not None:
            for result in results:
                self._record(result)

    def _task(self, index: int, spec: JobSpec) -> Task:
        prompt, request = spec.prompt, spec.request
        if spec.upload is not None:  # this rank's own copy: the ranks may not share a filesystem
            path = self.uploads / f"{spec.id}{spec.upload_suffix}"
            path.write_bytes(spec.upload)
            prompt = Prompt(prompt.text, prompt.negative_prompt, seed=prompt.seed, **{spec.upload_kind: str(path)})
        if spec.actions is not None:  # likewise: read by the engine as --actions FILE
            path = self.uploads / f"{spec.id}.actions.json"
            path.write_bytes(spec.actions)
            request = dataclasses.replace(request, actions=str(path))
        return Task(index, prompt, request, self.output_dir / spec.output_name, decode=True, key=spec.id)

    def _record(self, result: TaskResult) -> None:
        store, record = self.store, self.store.get(result.key)
        if record is None:
            return
        if result.status == COMPLETED:
            store.finish(
                result.key,
                job_states.COMPLETED,
                steps_run=result.steps_run,
                phase_seconds=vars(result.seconds),
                peak_device_bytes=result.peak_device_bytes,
                peak_rss_bytes=result.peak_rss_bytes,
                latent_sha256=result.latent_sha256,
                frames_sha256=result.frames_sha256,
                sound_sha256=result.sound_sha256,
                actions_shape=result.actions_shape,
                actions_sha256=result.actions_sha256,
                vae_decode=result.vae_decode,
            )
        elif result.status == CANCELLED:
            store.finish(result.key, job_states.CANCELLED, steps_run=result.steps_run)
        elif result.error.startswith(STOPPED_WITH_ROUND) and record.attempts < MAX_ATTEMPTS:
            store.requeue(record)  # another job's failure stopped it: it runs again
        else:
            store.finish(result.key, job_states.FAILED, error={"code": "generation_failed", "message": result.error})


__all__ = ["Command", "JobSpec", "ServerState", "Worker", "same_round"]
