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
