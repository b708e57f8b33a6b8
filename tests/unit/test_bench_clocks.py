"""bench.harness's orders and clocks, in one process: every method runs once per repetition in
a rotated order, a phase entered twice adds up, and a pipeline's step stamps give the steps."""

from __future__ import annotations

from bench import harness


def test_interleaved_runs_every_name_once_per_repetition_the_order_rotated():
    got = list(harness.interleaved("abc", 4))
    assert got == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"),
                   (2, "c"), (2, "a"), (2, "b"), (3, "a"), (3, "b"), (3, "c")]  # fmt: skip
    assert harness.rotated(["x", "y"], 5) == ["y", "x"]


def test_a_phase_entered_twice_adds_up_and_run_returns_the_result(monkeypatch):
    ticks = iter(range(100))
    monkeypatch.setattr(harness.time, "perf_counter", lambda: float(next(ticks)))
    phases = harness.Phases()
    assert phases.run("read", lambda: "out") == "out"  # clock 0 -> 1
    wrapped = phases.wrap("read", lambda x: x * 2)
    assert wrapped(4) == 8 and wrapped.__wrapped__(4) == 8  # clock 2 -> 3
    with phases("open"):  # clock 4 -> 5
        pass
    assert dict(phases.seconds) == {"read": 2.0, "open": 1.0} and set(phases.cpu) == {"read", "open"}


def test_step_stamps_give_the_loop_and_steps_after_the_first(monkeypatch):
    clock = iter([10.0, 13.0, 17.0])
    monkeypatch.setattr(harness.time, "perf_counter", lambda: next(clock))
    stamps = harness.StepStamps()
    for step in range(3):
        assert stamps(None, step, None, {}) == {}
    assert stamps.steps() == [3.0, 4.0] and stamps.since(9.0) == 8.0


def test_sample_seconds_keeps_before_outside_and_after_inside_each_timing(monkeypatch):
    clock = iter(range(100))
    calls = []
    monkeypatch.setattr(harness.time, "perf_counter", lambda: float(next(clock)))

    def before():
        calls.append("before")

    def after():
        calls.append("after")
        next(clock)  # the sync takes one tick: it is inside the timing

    samples = harness.sample_seconds(lambda: calls.append("fn"), 2, before=before, after=after)
    assert samples == [2.0, 2.0] and calls == ["before", "fn", "after"] * 2
