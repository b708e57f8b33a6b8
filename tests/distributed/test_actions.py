"""Action jobs (forward dynamics) from the launcher on the action demo (the demo with an
``action_gen`` transformer, a ModelOpt FP8 export with the published step policy): the latent at
2 ranks (FSDP), CFG 2 and Ulysses 2 equal to one rank's, the action tokens exchanged by the CFG
pair and split by the Ulysses group like the other modalities; the report names the mode.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest

pytest.importorskip("diffusers")
pytestmark = pytest.mark.timeout(900)

from ranks import run_ranks  # noqa: E402

LAYOUTS = {"fsdp": (), "cfg": ("--cfg-parallel",), "ulysses": ("--ulysses", "2")}
ACTIONS = [[0.1, -0.2], [0.3, 0.0], [0.5, 0.5], [-1.0, 2.0]]


@pytest.fixture(scope="module")
def action_root(demo_cache) -> str:
    from fsdp_fp8.generation.demo import action_demo_checkpoint

    return str(action_demo_checkpoint(demo_cache))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    from fsdp_fp8.generation.demo import action_demo_image

    root = tmp_path_factory.mktemp("action-inputs")
    action_demo_image().save(root / "first.png")
    (root / "actions.json").write_text(json.dumps(ACTIONS))
    return root


def _launch(root: str, inputs: str, report: Path, *extra: str, rank: int = 0) -> dict | None:
    from fsdp_fp8.cli.runner import main

    job = ["--action", "forward_dynamics", "--domain", "pusht", "--chunk-size", "4", "--resolution-tier", "256"]
    job += ["--actions", str(Path(inputs, "actions.json")), "--image", str(Path(inputs, "first.png"))]
    assert main(["--checkpoint", root, *job, "--steps", "2", *extra, "--report", str(report)]) == 0
    return json.loads(report.read_text()) if rank == 0 else None


def _observe(rank: int, world: int, root: str, inputs: str, reports: str) -> dict:
    with mock.patch.dict(os.environ, {"RANK": str(rank), "WORLD_SIZE": str(world)}):
        return {
            name: _launch(root, inputs, Path(reports, f"{name}.json"), *extra, rank=rank)
            for name, extra in LAYOUTS.items()
        }


@pytest.fixture(scope="module")
def observed(action_root, inputs, tmp_path_factory):
    reports = tmp_path_factory.mktemp("action-reports")
    one = _launch(action_root, str(inputs), reports / "one.json")
    return one, run_ranks(_observe, 2, action_root, str(inputs), str(reports), timeout=900)[0]


def _latent(report: dict) -> tuple:
    (row,) = report["outputs"]
    return row["mode"], tuple(row["latent_shape"]), row["latent_sha256"]


def test_forward_dynamics_is_named_and_rolls_the_chunk(observed):
    one, _ = observed
    mode, shape, _ = _latent(one)
    assert mode == "forward dynamics, pusht, chunk of 4 actions"
    assert shape == (1, 4, 2, 16, 16)  # 1 + 4 frames: two latent frames of the 64 x 64 content
    assert one["precision_trace"] == "W8A16 x2" and one["step_policy"] == "checkpoint"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_dynamics_latent_equals_one_rank(observed, layout):
    one, ranks = observed
    assert _latent(ranks[layout]) == _latent(one), layout


@pytest.mark.parametrize(
    ("actions", "extra", "reason"),
    [
        ("[[1, 2, 3]]", (), "has 3 values per action; --domain pusht takes 2"),
        ("[[1, NaN]]", (), "row 0 value 1 is nan; actions must be finite"),
        ("[[1, 2], [3]]", (), "is ragged"),
        ("[]", (), "holds no actions"),
        ("[[1, 2]]", ("--domain", "martian"), "--domain 'martian' is not one of diffusers' action domains: "),
        ("[[1, 2]]", ("--frames", "5"), "leave out --frames"),
    ],
)
def test_careless_action_input_is_refused_before_the_load(
    action_root, inputs, tmp_path, actions, extra, reason, capsys
):
    from fsdp_fp8.cli.runner import main

    (tmp_path / "actions.json").write_text(actions)
    job = ["--action", "forward_dynamics", "--domain", "pusht", "--chunk-size", "4"]
    job += ["--actions", str(tmp_path / "actions.json"), "--image", str(inputs / "first.png"), *extra]
    with mock.patch("fsdp_fp8.compose.pipeline.load_model") as load, pytest.raises(SystemExit) as exc:
        main(["--checkpoint", action_root, *job])
    assert exc.value.code == 2 and not load.called
    assert reason in capsys.readouterr().err.strip().splitlines()[-1]
