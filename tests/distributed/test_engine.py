"""The generation engine through the Python API (``fsdp_fp8.Engine``): many prompts over the
request groups with residency and the split decode at CFG 2 x Ulysses 2, the one-rank digests;
a request that fails on some ranks (before its first forward, or between two steps) fails on
every rank with its error named, its round stopped alike on every rank, and the next round runs;
a cancel stops a round at a step (every rank alike), or drops one request while its neighbour runs.

One spawn per world size runs every case on the demo.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytestmark = pytest.mark.timeout(900)

from ranks import run_ranks  # noqa: E402

STEPS = 3
PROMPTS = ["a red fox", {"prompt": "a lighthouse in a storm", "seed": 7}, "a quiet harbour at dawn"]


def _prompts_file(directory: Path) -> str:
    path = directory / "prompts.txt"
    path.write_text("\n".join(p if isinstance(p, str) else json.dumps(p) for p in PROMPTS) + "\n")
    return str(path)


def _truncated_png(directory: Path) -> str:
    """A PNG whose header is whole and whose pixels are cut short: it opens, it does not decode."""
    from PIL import Image

    path = directory / "truncated.png"
    Image.effect_noise((32, 32), 64).convert("RGB").save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return str(path)


def _rows(results) -> list[tuple]:
    return [(r.index, r.status, r.latent_sha256, r.frames_sha256) for r in results]


class _Cancel:
    """An observer (rank 0) that cancels ``keys`` from the first step on and records the progress."""

    def __init__(self, keys) -> None:
        self.keys, self.seen = frozenset(keys), []

    def on_step(self, key, index, step, steps) -> None:
        self.seen.append((key, step))

    def cancelled(self):
        return self.keys


def _api(rank: int, world: int, root: str, prompts: str) -> dict:
    """CFG 2 x Ulysses 2 at 4 ranks (1 rank: the reference), every prompt, residency and the split decode."""
    from fsdp_fp8 import Engine, GenerationRequest, RunSettings, load_pipeline, tasks_of

    layout = {"cfg_parallel": True, "ulysses": 2} if world == 4 else {}
    pipe = load_pipeline(root, device=torch.device("cpu"), **layout)
    engine = Engine(pipe, RunSettings(resident="all", vae_tiling="on"))
    request = GenerationRequest(prompts=prompts, steps=STEPS, frames=1, height=32, width=32)
    results = engine.generate(tasks_of(request, decode=True))
    return {
        "rows": _rows(results),
        "resident": len(engine.residency.resident),
        "frames_here": [r.frames is not None for r in results],
        "decode": [r.vae_decode for r in results],
    }


def _faults(rank: int, world: int, root: str, truncated: str) -> dict:
    """2 request groups of one rank each: failures and cancels, each followed by a round that runs."""
    from fsdp_fp8 import Engine, GenerationRequest, Prompt, RunSettings, Task, load_pipeline
    from fsdp_fp8.generation.engine import STOPPED_WITH_ROUND

    pipe = load_pipeline(root, device=torch.device("cpu"))
    engine = Engine(pipe, RunSettings())
    request = GenerationRequest(steps=STEPS, frames=5, height=32, width=32)

    def task(index: int, key: str = "", **prompt) -> Task:
        return Task(index, Prompt(prompt.pop("text", "a red fox"), seed=index, **prompt), request, key=key)

    obs = {"alone": _rows(engine.run_round([task(0)]))}
    # prompt 1's image opens (its header is whole) and fails to decode: before the first forward
    results = engine.run_round([task(0), task(1, image=truncated)])
    obs["before"] = [(r.status, r.error) for r in results]
    obs["stopped_with_round"] = results[0].error.startswith(STOPPED_WITH_ROUND)
    obs["after_before"] = _rows(engine.run_round([task(0)]))
    # rank 1's scheduler fails in its second step, after that step's forwards: between two steps
    held = pipe.scheduler.step
    calls = []

    def failing_step(*args, **kwargs):
        calls.append(1)
        if rank == 1 and len(calls) == 2:
            raise RuntimeError("injected: the scheduler failed")
        return held(*args, **kwargs)

    pipe.scheduler.step = failing_step
    results = engine.run_round([task(0), task(1)])
    del pipe.scheduler.step
    obs["between"] = [(r.status, r.error, r.steps_run) for r in results]
    obs["after_between"] = _rows(engine.run_round([task(0)]))
    # a cancel of every request of a round stops it after the first step, on every rank
    everyone = _Cancel({"a", "b"})
    results = engine.run_round([task(0, "a"), task(1, "b")], everyone)
    obs["all_cancelled"] = [(r.status, r.steps_run) for r in results]
    # a cancel of one request: its neighbour runs on to its own digest, the progress seen on rank 0
    one = _Cancel({"b"})
    results = engine.run_round([task(0, "a"), task(1, "b")], one)
    obs["one_cancelled"] = [(r.status, r.latent_sha256) for r in results]
    obs["progress"] = sorted(set(one.seen))
    return obs


@pytest.fixture(scope="module")
def api(demo_root, tmp_path_factory):
    prompts = _prompts_file(tmp_path_factory.mktemp("engine-prompts"))
    one = run_ranks(_api, 1, str(demo_root), prompts, timeout=400)[0]
    four = run_ranks(_api, 4, str(demo_root), prompts, timeout=800)
    return one, four


def test_many_prompts_at_cfg2_x_ulysses2_through_the_api_give_the_one_rank_digests(api):
    one, four = api
    assert [row[1] for row in one["rows"]] == ["completed"] * 3
    assert len({row[2] for row in one["rows"]}) == 3  # three requests, three latents
    assert all(rank["rows"] == one["rows"] for rank in four)  # latents and frames, on every rank
    assert four[0]["resident"] == one["resident"] > 0  # residency from the library call
    assert four[0]["frames_here"] == [True] * 3 and four[1]["frames_here"] == [False] * 3  # the writer's
    assert four[0]["decode"] == one["decode"] == ["untiled (--vae-tiling on: the latent fits one 256-pixel tile)"] * 3


@pytest.fixture(scope="module")
def faults(demo_root, tmp_path_factory):
    truncated = _truncated_png(tmp_path_factory.mktemp("engine-faults"))
    return run_ranks(_faults, 2, str(demo_root), truncated, timeout=800)


def test_every_rank_ends_with_the_same_results(faults):
    first, second = faults
    assert first == {**second, "progress": first["progress"]}


def test_a_failure_before_the_first_forward_fails_its_request_on_every_rank_and_stops_its_round(faults):
    (neighbour, error), (failed, message) = faults[0]["before"]
    assert (
        failed == "failed"
        and message.startswith("rank 1: ArgumentError: image ")
        and "truncated.png cannot be read" in message
    )
    assert "\n" not in message
    assert neighbour == "failed" and faults[0]["stopped_with_round"] and "rank 1: ArgumentError: image " in error
    assert faults[0]["after_before"] == faults[0]["alone"]  # the next round runs, to its own digest


def test_a_failure_between_steps_on_one_rank_stops_the_round_at_that_step_on_every_rank(faults):
    (neighbour, error, steps), (failed, message, _) = faults[0]["between"]
    assert failed == "failed" and message == "rank 1: RuntimeError: injected: the scheduler failed"
    assert neighbour == "failed" and "injected" in error and steps == 2
    assert faults[0]["after_between"] == faults[0]["alone"]


def test_cancels_stop_a_round_or_drop_one_request_beside_a_running_one(faults):
    assert faults[0]["all_cancelled"] == [("cancelled", 1), ("cancelled", 1)]
    (kept, digest), (dropped, _) = faults[0]["one_cancelled"]
    assert kept == "completed" and digest == faults[0]["alone"][0][2] and dropped == "cancelled"
    assert faults[0]["progress"] == [(key, step) for key in "ab" for step in range(1, STEPS + 1)]
