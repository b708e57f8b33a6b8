"""The server's jobs on rank 0: their records, the queue, cancels, and the files kept for them.

A job's record is the OpenAI Videos API's video object (``id``, ``object: "video"``, ``status``,
``progress``, ``created_at``, ...) with ours beside it: the request's values, the per-phase
seconds, the peak memory, the digests. Every change of state is written to ``<id>.json`` in the
output directory (a temporary file renamed into place), so a restarted server serves the
finished jobs again. Ids are ``video_`` and 32 random hex digits (``secrets``): unguessable, and
checked against that form before they name a file. Thread-safe: the HTTP thread and the worker
share one store.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_fp8.generation.results import actions_paths

QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELLED = "queued", "in_progress", "completed", "failed", "cancelled"
FINISHED = (COMPLETED, FAILED, CANCELLED)
ID_FORM = re.compile(r"video_[0-9a-f]{32}")


def new_id() -> str:
    return f"video_{secrets.token_hex(16)}"


def valid_id(job_id: str) -> bool:
    return ID_FORM.fullmatch(job_id) is not None


@dataclass
class JobRecord:
    """One job. ``request``: the request's values as sent to the ranks (JSON); ``upload``: the
    input reference kept beside the records (``uploads/<id><suffix>``), until the job ends;
    ``actions_upload``: an action job's raw actions, kept alike (``uploads/<id>.actions.json``).
    An action job that predicts actions has them beside its output (``<id>.actions.npy`` and
    ``.json``), ``actions_shape`` and ``actions_sha256`` in its record."""

    id: str
    prompt: str
    model: str
    size: str
    seconds: str
    created_at: int
    request: dict
    object: str = "video"
    status: str = QUEUED
    progress: int = 0
    phase: str = QUEUED
    completed_at: int | None = None
    error: dict | None = None  # {"code", "message"}
    upload: str | None = None
    upload_kind: str | None = None  # "image" or "video"
    actions_upload: str | None = None
    output: str | None = None  # the file's name in the output directory
    media_type: str | None = None
    steps_run: int = 0
    phase_seconds: dict = field(default_factory=dict)
    peak_device_bytes: int | None = None
    peak_rss_bytes: int | None = None
    latent_sha256: str | None = None
    frames_sha256: str | None = None
    sound_sha256: str | None = None
    actions_shape: list[int] | None = None
    actions_sha256: str | None = None
    vae_decode: str | None = None
    attempts: int = 0

    def api(self) -> dict:
        """The record as the API shows it (the uploads' places and the attempts are ours alone)."""
        out = dataclasses.asdict(self)
        for private in ("upload", "actions_upload", "attempts"):
            out.pop(private)
        return out


class JobStore:
    """Every job of this server, the queue's order, the cancels asked for running jobs."""

    def __init__(self, directory: Path, max_queue: int) -> None:
        self.directory = Path(directory)
        self.max_queue = max_queue
        self.jobs: dict[str, JobRecord] = {}
        self.queue: list[str] = []
        self.cancels: set[str] = set()
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        (self.directory / "uploads").mkdir(parents=True, exist_ok=True)

    def restore(self) -> int:
        """Read the records a previous server left: finished jobs are served again; a job it
        never finished failed (its upload and its place in the queue died with it)."""
        restored = 0
        for path in sorted(self.directory.glob("video_*.json")):
            if not valid_id(path.stem):
                continue
            try:
                fields = json.loads(path.read_text())
                record = JobRecord(**{k: v for k, v in fields.items() if k in _FIELDS})
            except (OSError, ValueError, TypeError):
                continue  # not one of ours: left alone
            if record.status not in FINISHED:
                record.status, record.phase = FAILED, FAILED
                record.error = {"code": "server_restarted", "message": "the server stopped before this job ran"}
                record.completed_at = record.completed_at or int(time.time())
                self._write(record)
            self.jobs[record.id] = record
            restored += 1
        return restored

    def add(self, record: JobRecord) -> bool:
        """Queue ``record``; False (nothing kept) when the queue is full."""
        with self.lock:
            if len(self.queue) >= self.max_queue:
                return False
            self.jobs[record.id] = record
            self.queue.append(record.id)
            self._write(record)
            self.changed.notify_all()
            return True

    def get(self, job_id: str) -> JobRecord | None:
        with self.lock:
            return self.jobs.get(job_id) if valid_id(job_id) else None

    def listed(self) -> list[JobRecord]:
        with self.lock:
            return sorted(self.jobs.values(), key=lambda r: (r.created_at, r.id))

    def update(self, job_id: str, **changes) -> None:
        with self.lock:
            record = self.jobs.get(job_id)
            if record is not None:
                self._apply(record, changes)

    def take(self, count: int, same_round) -> list[JobRecord]:
        """Up to ``count`` queued jobs that can share a round (``same_round(a, b)``), first in
        first out; they are in progress from here on."""
        with self.lock:
            if not self.queue:
                return []
            first = self.jobs[self.queue[0]]
            taken = [first] + [self.jobs[i] for i in self.queue[1:] if same_round(first, self.jobs[i])][: count - 1]
            for record in taken:
                self.queue.remove(record.id)
                record.status, record.phase, record.progress = IN_PROGRESS, "starting", 1
                record.attempts += 1
                self._write(record)
            return taken

    def requeue(self, record: JobRecord) -> None:
        """Back to the front of the queue (its round stopped for another job's failure)."""
        with self.lock:
            record.status, record.phase, record.progress = QUEUED, QUEUED, 0
            self.queue.insert(0, record.id)
            self._write(record)

    def cancel(self, job_id: str) -> str | None:
        """Cancel a job: a queued one leaves the queue at once (cancelled); a running one is
        stopped by its ranks at their next step boundary. The status it had, or None."""
        with self.lock:
            record = self.jobs.get(job_id)
            if record is None:
                return None
            before = record.status
            if before == QUEUED:
                self.queue.remove(job_id)
                record.status, record.phase, record.completed_at = CANCELLED, CANCELLED, int(time.time())
                self._write(record)
            elif before == IN_PROGRESS:
                self.cancels.add(job_id)
            return before

    def forget(self, job_id: str) -> bool:
        """Remove a finished job: its record and its files."""
        with self.lock:
            record = self.jobs.get(job_id)
            if record is None or record.status not in FINISHED:
                return False
            del self.jobs[job_id]
            outputs = [record.output, *(p.name for p in actions_paths(Path(record.output)))] if record.output else []
            for name in (f"{job_id}.json", *outputs):
                (self.directory / name).unlink(missing_ok=True)
            self._remove_upload(record)
            return True

    def cancelled_running(self) -> frozenset[str]:
        with self.lock:
            return frozenset(self.cancels)

    def fail_unfinished(self, code: str, message: str) -> None:
        """Every queued and running job fails with ``message`` (a rank was lost)."""
        with self.lock:
            for record in list(self.jobs.values()):
                if record.status in (QUEUED, IN_PROGRESS):
                    self._end(record, FAILED, error={"code": code, "message": message})
            self.queue.clear()

    def drop_queued(self, message: str) -> None:
        """Every queued job is cancelled with ``message`` (the server is stopping)."""
        with self.lock:
            for job_id in list(self.queue):
                self._end(self.jobs[job_id], CANCELLED, error={"code": "server_stopping", "message": message})
            self.queue.clear()

    def counts(self) -> dict[str, int]:
        with self.lock:
            out = dict.fromkeys((QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELLED), 0)
            for record in self.jobs.values():
                out[record.status] += 1
            return out

    def finish(self, job_id: str, status: str, **changes) -> None:
        """A job ends: its status, its fields, its upload removed, its cancel forgotten."""
        with self.lock:
            record = self.jobs.get(job_id)
            if record is not None:
                self._end(record, status, **changes)

    def _end(self, record: JobRecord, status: str, **changes) -> None:
        """(lock held) ``record`` ends as ``status`` with ``changes``; written, waiters told."""
        record.status, record.phase, record.completed_at = status, status, int(time.time())
        if status == COMPLETED:
            record.progress = 100
        self.cancels.discard(record.id)
        self._remove_upload(record)
        self._apply(record, changes)

    def _apply(self, record: JobRecord, changes: dict) -> None:
        """(lock held) ``changes`` into ``record``; written, waiters told."""
        for key, value in changes.items():
            setattr(record, key, value)
        self._write(record)
        self.changed.notify_all()

    def _remove_upload(self, record: JobRecord) -> None:
        for name in (record.upload, record.actions_upload):
            if name:
                (self.directory / "uploads" / name).unlink(missing_ok=True)
        record.upload, record.actions_upload = None, None

    def _write(self, record: JobRecord) -> None:
        """``<id>.json``, whole or not at all (a temporary file renamed into place)."""
        path = self.directory / f"{record.id}.json"
        temporary = path.with_name(f".{record.id}.{os.getpid()}.partial")
        temporary.write_text(json.dumps(dataclasses.asdict(record), indent=1))
        os.replace(temporary, path)


_FIELDS = {f.name for f in dataclasses.fields(JobRecord)}

__all__ = ["CANCELLED", "COMPLETED", "FAILED", "IN_PROGRESS", "QUEUED", "JobRecord", "JobStore", "new_id"]
