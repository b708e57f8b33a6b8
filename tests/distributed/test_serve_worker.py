"""The server's loop on one process, the demo loaded once: progress at every step, a cancel of a
running job within one step, and twenty requests failing inside the pipeline leaving the memory
held where the first left it. The HTTP side and two ranks: test_serve.py."""

from __future__ import annotations

import threading
import time

import pytest
from calibration import bound

pytest.importorskip("fastapi")


class WatchedStore:
    """A job store whose every change is also kept in order (the HTTP thread sees the same)."""

    def __new__(cls, directory):
        from fsdp_fp8.serve.jobs import JobStore

        class Watched(JobStore):
            def __init__(self, directory) -> None:
                super().__init__(directory, max_queue=100)
                self.changes: list[tuple[str, dict]] = []
                self.on_change = None

            def update(self, job_id: str, **changes) -> None:
                super().update(job_id, **changes)
                self.changes.append((job_id, changes))
                if self.on_change is not None:
                    self.on_change(job_id, changes)

        return Watched(directory)


@pytest.fixture(scope="module")
def engine(demo_root):
    from fsdp_fp8 import Engine, load_pipeline

    return Engine(load_pipeline(str(demo_root)))


def _job(store, prompt: str, steps: int, **values):
    """A queued job as POST /v1/videos makes it."""
    from fsdp_fp8.serve.jobs import JobRecord, new_id

    request = {"steps": steps, "seed": 0, "guidance": 3.0, "frames": 1, "width": 32, "height": 32} | values
    record = JobRecord(new_id(), prompt, "demo", "32x32", "0", int(time.time()), request)
    record.output = f"{record.id}.png" if request["frames"] == 1 else f"{record.id}.mp4"
    assert store.add(record)
    return record.id


def _serve_until_done(engine, store, directory, ids: list[str]) -> None:
    """The loop of ``serve`` on this one rank until every job in ``ids`` has ended."""
    from fsdp_fp8.serve.jobs import FINISHED
    from fsdp_fp8.serve.worker import ServerState, Worker

    state = ServerState()
    worker = Worker(engine, directory, 60.0, store, state, drain_s=0.0)
    thread = threading.Thread(target=worker.run)
    thread.start()
    deadline = time.monotonic() + bound(120)
    while time.monotonic() < deadline and not all(store.get(i).status in FINISHED for i in ids):
        time.sleep(0.05)
    state.draining_since = time.monotonic()  # the loop's own way out: stop
    thread.join(bound(60))
    assert not thread.is_alive()


def test_progress_moves_at_every_step_and_ends_at_100(engine, tmp_path):
    store = WatchedStore(tmp_path)
    job = _job(store, "a red fox", steps=5)
    _serve_until_done(engine, store, tmp_path, [job])
    progress = [c["progress"] for i, c in store.changes if i == job and "progress" in c]
    assert len(progress) == 5 and progress == sorted(set(progress)) and progress[-1] < 100
    assert store.get(job).status == "completed" and store.get(job).progress == 100
    assert (tmp_path / store.get(job).output).read_bytes()[:4] == b"\x89PNG"


def test_a_cancel_stops_a_running_job_at_the_next_step(engine, tmp_path):
    store = WatchedStore(tmp_path)
    job = _job(store, "a long one", steps=40)

    def cancel_at_step_two(job_id, changes):
        if changes.get("steps_run") == 2:
            store.cancel(job_id)  # what DELETE does, from the HTTP thread

    store.on_change = cancel_at_step_two
    _serve_until_done(engine, store, tmp_path, [job])
    record = store.get(job)
    assert record.status == "cancelled" and record.steps_run <= 3, record
    assert not (tmp_path / f"{job}.png").exists()


def test_twenty_requests_failing_in_the_pipeline_leave_memory_where_one_left_it(engine, tmp_path):
    """Each fails at its very end, its frames decoded (the output's place is a directory, as a full
    or broken disk would fail it). The memory: every live tensor's bytes, as /metrics counts them."""
    from fsdp_fp8.serve.main import held_bytes

    held = held_bytes(engine.device)
    store = WatchedStore(tmp_path)

    def failing(count: int) -> int:
        """``count`` failing jobs, queued at once and served; the bytes held after them."""
        jobs = [_job(store, "fails", steps=2, frames=5) for _ in range(count)]
        for job in jobs:
            (tmp_path / store.get(job).output).mkdir()
        _serve_until_done(engine, store, tmp_path, jobs)
        for job in jobs:
            record = store.get(job)
            assert record.status == "failed" and "IsADirectoryError" in record.error["message"], record
        return held()

    after_one = failing(1)
    after_twenty = failing(19)
    assert after_twenty <= after_one, (after_one, after_twenty)
    ok = _job(store, "still serving", steps=2)
    _serve_until_done(engine, store, tmp_path, [ok])
    assert store.get(ok).status == "completed"


def test_a_round_the_engine_refuses_fails_its_jobs_and_the_server_goes_on(engine, tmp_path, monkeypatch):
    """A refusal the engine raises alike on every rank before any call (a mixed round, a distilled
    root's other schedule, which the HTTP checks keep out) fails the round's jobs with its reason;
    the loop serves the next job (it once ended the server)."""
    from fsdp_fp8.errors import ArgumentError

    store = WatchedStore(tmp_path)
    refused, ok = _job(store, "refused", steps=2), _job(store, "served", steps=2)
    real_run_round = engine.run_round

    def refuse_the_first(tasks, observer=None):
        if any(t.key == refused for t in tasks):
            raise ArgumentError("this schedule runs 4 steps, got 2", "cannot run the round")
        return real_run_round(tasks, observer)

    monkeypatch.setattr(engine, "run_round", refuse_the_first)
    _serve_until_done(engine, store, tmp_path, [refused, ok])
    assert store.get(refused).status == "failed"
    assert store.get(refused).error == {"code": "invalid_request", "message": "this schedule runs 4 steps, got 2"}
    assert store.get(ok).status == "completed"


def test_a_round_mixing_sound_and_silent_requests_is_refused_before_any_call(engine):
    """Its ranks would gather different blocks at once (the sound tower): a collective mismatch."""
    from fsdp_fp8 import GenerationRequest, Prompt
    from fsdp_fp8.errors import ArgumentError
    from fsdp_fp8.generation.engine import Task

    silent = Task(0, Prompt("a"), GenerationRequest(steps=2, frames=5, width=32, height=32))
    loud = Task(1, Prompt("b"), GenerationRequest(steps=2, frames=5, width=32, height=32, sound=True))
    with pytest.raises(ArgumentError, match="sound or not"):
        engine.run_round([silent, loud])


def test_a_restarted_store_serves_finished_jobs_again_and_fails_the_unfinished(tmp_path):
    """Records are files: a new store on the directory finds them (a server restart)."""
    from fsdp_fp8.serve.jobs import JobStore

    before = JobStore(tmp_path, max_queue=4)
    done, waiting = _job(before, "done", steps=2), _job(before, "waiting", steps=2)
    before.take(1, lambda a, b: False)
    before.finish(done, "completed", latent_sha256="ab" * 32)
    (tmp_path / "video_not-an-id.json").write_text("{}")  # not one of ours: left alone
    after = JobStore(tmp_path, max_queue=4)
    assert after.restore() == 2
    assert after.get(done).status == "completed" and after.get(done).latent_sha256 == "ab" * 32
    assert after.get(waiting).status == "failed" and after.get(waiting).error["code"] == "server_restarted"
    assert after.queue == [] and after.get("../video_not-an-id") is None
