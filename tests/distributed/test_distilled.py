"""Distilled 4-step roots (diffusers' ``Cosmos3DistilledModularPipeline``): the distilled demo
(the demo's random components, ``modular_model_index.json`` with a fixed ``distilled_sigmas``, the
transformer a ModelOpt FP8 export without a step policy) run by the launcher, text-to-image on one
rank, the report naming the mode; at Ulysses 2 its latent equals one rank's. ``--steps`` /
``--guidance`` off the schedule and ``--cfg-parallel`` refused before the load, one line, exit 2;
through the Python API one error on every rank. The non-distilled modular pipeline
(``Cosmos3OmniModularPipeline``, the demo's components) runs through the same modular path,
guidance, a negative prompt and sound included: the digests of ``Cosmos3OmniPipeline`` on one
rank, and at CFG 2 and Ulysses 2 (in the same run of 2 ranks).

The same spawn runs a root of the real ModelOpt 0.47 distilled fixture (tests/fixtures/
``modelopt-0.47-cosmos3-distilled-transformer``, calibrated through diffusers' own distilled
pipeline; no step policy, as ModelOpt wrote it) beside the distilled demo's other components:
text-to-image and text- and image-to-video (one prompts file: at replicas 2 a request a replica) on
one rank, at 2 ranks (FSDP), Ulysses 2 and HSDP replicas 2, the one-rank latents of that root.
Every step of a distilled root is W8A8 (``torch._scaled_mm``, CPU's slow reference kernel), and the
fixture's hidden 32 makes its forward about a tenth of the demo's: so every job runs at every layout
on the fixture, the demo one job at one layout, and the tests that run one more request (a plain
``model_index.json``, a cancel, the server at Ulysses 2) run the fixture root. Served over HTTP, a
request that leaves the steps and guidance out runs the schedule and gives the launcher's one-rank
digests; one off the schedule, or an action job, is a 400 naming why.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

pytest.importorskip("diffusers")
pytestmark = pytest.mark.timeout(900)

from pipelines import DISTILLED_FIXTURE  # noqa: E402
from ranks import run_ranks  # noqa: E402

SIZE = ("--height", "32", "--width", "32")
LAYOUTS = {"fsdp": (), "ulysses": ("--ulysses", "2"), "replicas": ("--replicas", "2")}
JOBS = ("image", "videos")  # text-to-image; text- and image-to-video (one prompts file, 5 frames)
# The demo's job, on one rank and at its layout of 2 ranks (Ulysses 2: the transformer sharded over
# both ranks and the tokens split between them); the fixture root runs every job at every layout in
# the same spawn. W8A8 on CPU is a reference kernel: one demo image costs two or three of the fixture's.
DEMO_JOBS = ("image",)
DEMO_LAYOUTS = ("ulysses",)
MODE = "distilled, 4 steps"
# the non-distilled modular pipeline's job: guidance with a negative prompt, sound, W8A16 and W8A8 steps
OMNI_JOB = ("--frames", "5", "--sound", "--negative-prompt", "blur", "--steps", "7")
OMNI_LAYOUTS = {"cfg": ("--cfg-parallel",), "ulysses": ("--ulysses", "2")}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    from PIL import Image

    root = tmp_path_factory.mktemp("distilled-inputs")
    pixels = np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(root / "still.png")
    lines = ["a red fox", json.dumps({"prompt": "the arm picks up the cup", "image": "still.png", "seed": 3})]
    (root / "requests.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _launch(root: str, report: Path, *extra: str, rank: int = 0) -> dict | None:
    from fsdp_fp8.cli.runner import main

    assert main(["--checkpoint", root, *SIZE, *extra, "--report", str(report)]) == 0
    return json.loads(report.read_text()) if rank == 0 else None


def _jobs(root: str, inputs: str, reports: Path, name: str, extra: tuple, rank: int = 0, jobs=JOBS) -> dict:
    """Text-to-image, and a text-to-video and an image-to-video request of one prompts file (``jobs``)."""
    decoded = ("--output", str(reports / f"{name}-image.png"))  # decoded and written by the request's writer
    prompts = ("--prompts", str(Path(inputs, "requests.jsonl")), "--frames", "5")
    args = {"image": ("--frames", "1", *decoded), "videos": prompts}
    return {
        f"{name} {job}": _launch(root, reports / f"{name}-{job}.json", *args[job], *extra, rank=rank) for job in jobs
    }


def _api_refusals(rank: int) -> list[str]:
    """The Python API: a request off the schedule, and CFG-parallel, each one error on every rank."""
    import torch

    from fsdp_fp8 import load_pipeline
    from fsdp_fp8.generation.engine import Engine, tasks_of
    from fsdp_fp8.generation.values import GenerationRequest

    root = os.environ["DISTILLED_ROOT"]
    seen = []
    try:
        load_pipeline(root, device=torch.device("cpu"), cfg_parallel=True)
    except ValueError as exc:
        seen.append(f"{type(exc).__name__}: {exc}")
    engine = Engine(load_pipeline(root, device=torch.device("cpu")))
    try:
        engine.generate(tasks_of(GenerationRequest(prompt="a fox", frames=1, height=32, width=32, steps=3)))
    except ValueError as exc:
        seen.append(f"{type(exc).__name__}: {exc}")
    return seen


def _observe(rank: int, world: int, root: str, fixture: str, inputs: str, reports: str, omni: str) -> dict:
    obs = {}
    with mock.patch.dict(os.environ, {"RANK": str(rank), "WORLD_SIZE": str(world), "DISTILLED_ROOT": root}):
        for name, extra in LAYOUTS.items():
            if name in DEMO_LAYOUTS:
                obs |= _jobs(root, inputs, Path(reports), name, extra, rank, DEMO_JOBS)
            obs |= _jobs(fixture, inputs, Path(reports), f"fixture {name}", extra, rank)
        obs["api"] = _api_refusals(rank)
        for name, extra in OMNI_LAYOUTS.items():
            obs[f"omni {name}"] = _launch(omni, Path(reports, f"omni-{name}.json"), *OMNI_JOB, *extra, rank=rank)
    return obs


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("distilled-reports")


@pytest.fixture(scope="module")
def omni_root(demo_root, tmp_path_factory) -> str:
    """The demo's components under an index naming diffusers' non-distilled modular pipeline,
    ``Cosmos3OmniModularPipeline`` (its default blocks, ``Cosmos3OmniBlocks``)."""
    import shutil

    root = tmp_path_factory.mktemp("omni-modular") / "root"
    shutil.copytree(demo_root, root)
    index = json.loads((root / "model_index.json").read_text())
    (root / "model_index.json").write_text(json.dumps({**index, "_class_name": "Cosmos3OmniModularPipeline"}))
    return str(root)


@pytest.fixture(scope="module")
def omni_one(omni_root, demo_root, reports) -> dict:
    """The modular job on one rank, and the same job on the demo's own ``Cosmos3OmniPipeline``."""
    return {
        "modular": _launch(omni_root, reports / "omni-one.json", *OMNI_JOB),
        "plain": _launch(str(demo_root), reports / "plain-one.json", *OMNI_JOB),
    }


@pytest.fixture(scope="module")
def fixture_root(distilled_root, tmp_path_factory) -> str:
    """The ModelOpt distilled fixture beside the distilled demo's VAE, scheduler and index."""
    from pipelines import pipeline_beside_the_demo

    root = tmp_path_factory.mktemp("distilled-fixture") / "root"
    return pipeline_beside_the_demo(Path(distilled_root), root, DISTILLED_FIXTURE, policy=False)


@pytest.fixture(scope="module")
def one_rank(distilled_root, fixture_root, inputs, reports):
    """One rank's reports: the demo's ``one image``, the fixture root's ``fixture one image`` /
    ``fixture one videos``; and the reports' folder."""
    one = _jobs(distilled_root, str(inputs), reports, "one", (), jobs=DEMO_JOBS)
    return one | _jobs(fixture_root, str(inputs), reports, "fixture one", ()), reports


@pytest.fixture(scope="module")
def one(one_rank) -> dict:
    """The launcher's reports on one rank."""
    return one_rank[0]


@pytest.fixture(scope="module")
def observed(one_rank, distilled_root, fixture_root, inputs, omni_root):
    """One rank's reports and every rank's of the 2-rank spawn."""
    one, reports = one_rank
    args = (distilled_root, fixture_root, str(inputs), str(reports), omni_root)
    ranks = run_ranks(_observe, 2, *args, timeout=900)
    return one, ranks


def _latents(report: dict) -> list[tuple[str, str, str | None]]:
    return [(r["mode"], r["latent_sha256"], r.get("frames_sha256")) for r in report["outputs"]]


def test_distilled_modes_name_the_schedule(one_rank):
    one, _ = one_rank
    assert one["one image"]["pipeline"] == "Cosmos3DistilledModularPipeline"
    assert one["one image"]["steps"] == 4 and one["one image"]["precision_trace"] == "W8A8 x4"
    assert one["one image"]["step_policy"] == "none"
    (row,) = one["one image"]["outputs"]
    assert row["output"].endswith("one-image.png") and row["frames_sha256"]
    assert [m for m, *_ in _latents(one["one image"])] == [f"text-to-image, {MODE}"]
    assert [m for m, *_ in _latents(one["fixture one videos"])] == [
        f"text-to-video, 5 frames, {MODE}",
        f"image-to-video, 5 frames, {MODE}",
    ]
    assert len({d for _, d, _ in _latents(one["fixture one videos"])}) == 2


@pytest.mark.parametrize("layout", DEMO_LAYOUTS)
def test_distilled_latents_equal_one_rank(observed, layout):
    one, ranks = observed
    for job in DEMO_JOBS:
        assert _latents(ranks[0][f"{layout} {job}"]) == _latents(one[f"one {job}"]), (layout, job)


def test_the_fixture_root_runs_the_fixture_on_the_schedule(one_rank):
    """ModelOpt's 31 FP8 linears (its recipe quantizes ``proj_in`` and ``time_embedder``, the
    demo's export does not), every step W8A8, other latents than the demo's."""
    one, _ = one_rank
    for job in JOBS:
        report = one[f"fixture one {job}"]
        assert report["pipeline"] == "Cosmos3DistilledModularPipeline" and report["step_policy"] == "none"
        assert report["precision_trace"] == "W8A8 x4" and report["fp8_linears"] == 31
    for job in DEMO_JOBS:
        assert one[f"one {job}"]["fp8_linears"] == 28
        fixture, demo = _latents(one[f"fixture one {job}"]), _latents(one[f"one {job}"])
        assert [m for m, *_ in fixture] == [m for m, *_ in demo]  # the same requests ...
        assert all(f[1] != d[1] for f, d in zip(fixture, demo))  # ... on another transformer


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_fixture_roots_latents_equal_one_rank(observed, layout):
    one, ranks = observed
    for job in JOBS:
        got, want = _latents(ranks[0][f"fixture {layout} {job}"]), _latents(one[f"fixture one {job}"])
        assert got == want, (layout, job)


def test_the_distilled_fixture_is_modelopts_own_export():
    """What ModelOpt 0.47 wrote (tests/fixtures/make_hf_fixtures.py): its producer and recipe, no
    step policy (so every step W8A8), both towers FP8 with input scales."""
    import torch

    from fsdp_fp8 import load_model

    config = json.loads((DISTILLED_FIXTURE / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["producer"] == {"name": "modelopt", "version": "0.47.0"} and quant["quant_method"] == "modelopt"
    assert quant["quant_algo"] == "FP8" and "runtime" not in quant
    loaded = load_model(None, DISTILLED_FIXTURE, device=torch.device("cpu"))
    assert loaded.checkpoint.quant.step_policy is None
    towers = [loaded.towers[name] for name in loaded.fp8_linears]
    assert len(towers) == 31 and towers.count("reasoner") == towers.count("generation") == 14


def test_distilled_api_refusals_on_every_rank(observed):
    _, ranks = observed
    assert ranks[0]["api"] == ranks[1]["api"] and len(ranks[0]["api"]) == 2
    cfg, steps = ranks[0]["api"]
    assert cfg.startswith("LayoutError") and "no CFG pair" in cfg
    assert steps.startswith("ArgumentError") and "`distilled_sigmas` config (4 steps): steps must be 4, got 3" in steps


def _digests(report: dict) -> tuple:
    (row,) = report["outputs"]
    return report["precision_trace"], row["mode"], row["latent_sha256"], row["sound_sha256"]


def test_the_omni_modular_pipeline_gives_the_plain_pipelines_digests(omni_one):
    modular, plain = omni_one["modular"], omni_one["plain"]
    assert (modular["pipeline"], plain["pipeline"]) == ("Cosmos3OmniModularPipeline", "Cosmos3OmniPipeline")
    assert _digests(modular) == _digests(plain)
    assert _digests(modular)[:2] == ("W8A16 x3 / W8A8 x1 / W8A16 x3", "text-to-video, 5 frames, sound")


@pytest.mark.parametrize("layout", list(OMNI_LAYOUTS))
def test_the_omni_modular_pipeline_equals_one_rank(observed, omni_one, layout):
    _, ranks = observed
    assert _digests(ranks[0][f"omni {layout}"]) == _digests(omni_one["modular"]), layout


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (("--steps", "3"), "steps must be 4, got 3"),
        (("--guidance", "2"), "guidance must be 1.0, got 2.0"),
        (("--cfg-parallel",), "--cfg-parallel: {root} is a distilled checkpoint"),
    ],
)
def test_distilled_refusals_before_the_load(distilled_root, extra, reason, capsys):
    from fsdp_fp8.cli.runner import main

    with mock.patch("fsdp_fp8.compose.pipeline.load_model") as load, pytest.raises(SystemExit) as exc:
        main(["--checkpoint", distilled_root, *SIZE, *extra])
    assert exc.value.code == 2 and not load.called
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert reason.format(root=distilled_root) in err


def test_a_root_whose_model_index_names_the_distilled_pipeline_runs_alike(fixture_root, one_rank, tmp_path):
    """A distilled root (the fixture's) with a plain ``model_index.json`` (entries without a loading
    spec) instead of ``modular_model_index.json``: the same pipeline, the same latent."""
    import shutil

    root = tmp_path / "root"
    shutil.copytree(fixture_root, root)
    modular = json.loads((root / "modular_model_index.json").read_text())
    (root / "modular_model_index.json").unlink()
    index = {k: v[:2] if isinstance(v, list) and len(v) == 3 else v for k, v in modular.items()}
    (root / "model_index.json").write_text(json.dumps(index))
    report = _launch(str(root), tmp_path / "report.json", "--frames", "1")
    assert report["pipeline"] == "Cosmos3DistilledModularPipeline"
    assert _latents(report)[0][:2] == _latents(one_rank[0]["fixture one image"])[0][:2]


def test_a_cancel_stops_the_distilled_loop_and_the_next_request_runs_whole(fixture_root):
    """The step callback (our block at the end of diffusers' denoising loop) stops the loop when
    every request of the round is cancelled, and diffusers logs no error for it; the next request
    runs its 4 steps (on the fixture root: a tenth of the demo's W8A8 work)."""
    import torch

    from fsdp_fp8 import load_pipeline
    from fsdp_fp8.generation.engine import Engine, Observer, tasks_of
    from fsdp_fp8.generation.values import GenerationRequest
    from fsdp_fp8.interop.modular import DIFFUSERS_BLOCKS_LOGGER

    class CancelAfterOne(Observer):
        steps = 0

        def on_step(self, task_key, index, step, steps):
            self.steps = step

        def cancelled(self):
            return frozenset({"a"}) if self.steps >= 1 else frozenset()

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.ERROR)
            self.seen = []

        def emit(self, record):
            self.seen.append(record.getMessage())

    records = Records()
    logging.getLogger(DIFFUSERS_BLOCKS_LOGGER).addHandler(records)  # after the logger's filters
    pipe = load_pipeline(fixture_root, device=torch.device("cpu"))
    forwards = []
    pipe.transformer.register_forward_pre_hook(lambda *_: forwards.append(1))
    engine = Engine(pipe)
    request = GenerationRequest(prompt="a fox", frames=1, height=32, width=32, steps=4, guidance=1.0)
    (cancelled,) = engine.generate(tasks_of(request, key="a"), CancelAfterOne())
    assert cancelled.status == "cancelled" and len(forwards) == 2
    logging.getLogger(DIFFUSERS_BLOCKS_LOGGER).removeHandler(records)
    assert records.seen == []
    (done,) = engine.generate(tasks_of(request, key="b"))
    assert done.status == "completed" and len(forwards) == 6


def test_inspect_forecasts_a_distilled_root_as_a_pipeline(distilled_root, capsys):
    """``inspect`` reads a modular root's index as a pipeline's: the whole job, the VAE included."""
    from fsdp_fp8.cli import commands

    assert commands.main(["inspect", distilled_root, "--world-size", "2", *SIZE, "--frames", "1"]) == 0
    out = capsys.readouterr().out
    assert "whole job per GPU" in out and "step policy:     none" in out


def test_values_without_the_launchers_given_options_are_checked_as_they_are(distilled_root):
    """A served request's values (no ``given``: every field is the request's) off the schedule are
    refused at submission, not at their round (where the engine raises for the whole round)."""
    from fsdp_fp8.generation.inputs import pipeline_problems
    from fsdp_fp8.generation.values import GenerationRequest, OptionValues, RunSettings

    settings = RunSettings(checkpoint=distilled_root)
    default = OptionValues(GenerationRequest(frames=1, height=32, width=32), settings)
    problems = pipeline_problems(default, Path(distilled_root))
    assert any("steps must be 4, got 20" in p for p in problems), problems
    assert any("guidance must be 1.0, got 3.0" in p for p in problems), problems
    scheduled = OptionValues(GenerationRequest(frames=1, height=32, width=32, steps=4, guidance=1.0), settings)
    assert pipeline_problems(scheduled, Path(distilled_root)) == []


@pytest.fixture(scope="module")
def server(fixture_root, demo_cache, tmp_path_factory):
    """The fixture's distilled root served at Ulysses 2 on 2 ranks, each at this process's thread
    count (the launcher's one-rank run here had it)."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    import torch
    from servers import Ranks

    directory = tmp_path_factory.mktemp("distilled-serve")
    threads = torch.get_num_threads()
    ranks = Ranks(2, directory, str(demo_cache), "--checkpoint", fixture_root, "--ulysses", "2", threads=threads)
    yield ranks
    ranks.stop()


def test_a_served_request_runs_the_schedule_with_the_launchers_one_rank_digests(one, server):
    from servers import openai_client

    from fsdp_fp8.generation.values import DEFAULT_PROMPT

    client = openai_client(server)
    video = client.videos.create(prompt=DEFAULT_PROMPT, size="32x32", extra_body={"num_frames": 1})
    assert client.videos.poll(video.id, poll_interval_ms=200).status == "completed"
    record = server.get(f"/v1/videos/{video.id}")[1]
    assert record["request"]["steps"] == 4 and record["request"]["guidance"] == 1.0 and record["steps_run"] == 4
    (row,) = one["fixture one image"]["outputs"]
    assert (record["latent_sha256"], record["frames_sha256"]) == (row["latent_sha256"], row["frames_sha256"])


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"num_inference_steps": 8}, "`distilled_sigmas` config (4 steps): steps must be 4, got 8"),
        ({"guidance_scale": 3}, "classifier-free guidance is baked into the weights: guidance must be 1.0, got 3.0"),
        ({"negative_prompt": "blur"}, "is a distilled checkpoint; it takes no negative prompt"),
        (
            {"action_mode": "policy", "domain_name": "pusht", "chunk_size": 4},
            "--action: {root}/transformer/config.json has no `action_gen`: its transformer takes no actions",
        ),
    ],
    ids=["steps", "guidance", "negative-prompt", "action"],
)
def test_a_served_request_the_distilled_root_cannot_run_is_a_400_naming_why(server, fixture_root, fields, reason):
    status, body, _ = server.post({"prompt": "x", "size": "32x32", **fields})
    assert status == 400 and reason.format(root=fixture_root) in body["error"]["message"], body
