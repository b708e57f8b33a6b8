"""Action jobs from the launcher on the action demo (the demo with an ``action_gen`` transformer,
a ModelOpt FP8 export with the published step policy): forward dynamics, policy and inverse
dynamics, each latent and each predicted actions' digest at 2 ranks (FSDP), CFG 2, Ulysses 2 and
(4 ranks) CFG 2 x Ulysses 2 equal to one rank's, the action tokens exchanged by the CFG pair and
split by the Ulysses group like the other modalities; the predicted actions written beside the
video; the report names the mode; careless input refused before the load. The same jobs served
over HTTP (``serve`` at CFG 2 on 2 ranks, the official ``openai`` client) give the launcher's
one-rank digests and serve the predicted actions; careless input there is one 400 naming every
problem.
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
def inputs(tmp_path_factory) -> Path:
    """The first frame, the raw actions, and a 5-frame clip (a directory of frames)."""
    import numpy as np
    from PIL import Image

    from fsdp_fp8.generation.demo import action_demo_image

    root = tmp_path_factory.mktemp("action-inputs")
    action_demo_image().save(root / "first.png")
    (root / "actions.json").write_text(json.dumps(ACTIONS))
    (root / "clip").mkdir()
    frames = [
        Image.fromarray(np.random.default_rng(10 + i).integers(0, 256, (64, 64, 3), dtype=np.uint8)) for i in range(5)
    ]
    for i, frame in enumerate(frames):
        frame.save(root / "clip" / f"{i:03d}.png")
    frames[0].save(root / "clip.png", save_all=True, append_images=frames[1:])  # the same frames, one upload
    return root


MODES = {
    "forward_dynamics": ("--actions", "actions.json", "--image", "first.png"),
    "policy": ("--image", "first.png"),
    "inverse_dynamics": ("--video", "clip"),
}


def _launch(root: str, inputs: str, out: Path, mode: str, *extra: str, rank: int = 0) -> dict | None:
    """One launcher run of ``mode``; its report (rank 0). The video (and the predicted actions)
    go to ``out``.png."""
    from fsdp_fp8.cli.runner import main

    job = ["--action", mode, "--domain", "pusht", "--chunk-size", "4", "--resolution-tier", "256"]
    job += [str(Path(inputs, a)) if a in ("actions.json", "first.png", "clip") else a for a in MODES[mode]]
    job += ["--output", f"{out}.png", "--report", f"{out}.json"]
    assert main(["--checkpoint", root, *job, "--steps", "2", *extra]) == 0
    return json.loads(Path(f"{out}.json").read_text()) if rank == 0 else None


def _observe(rank: int, world: int, root: str, inputs: str, reports: str) -> dict:
    with mock.patch.dict(os.environ, {"RANK": str(rank), "WORLD_SIZE": str(world)}):
        return {
            (layout, mode): _launch(root, inputs, Path(reports, f"{layout}-{mode}"), mode, *extra, rank=rank)
            for layout, extra in LAYOUTS.items()
            for mode in MODES
        }


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("action-reports")


@pytest.fixture(scope="module")
def one(action_root, inputs, reports) -> dict:
    """Each mode's report from the launcher on one rank."""
    return {mode: _launch(action_root, str(inputs), reports / f"one-{mode}", mode) for mode in MODES}


@pytest.fixture(scope="module")
def observed(action_root, inputs, one, reports):
    return one, run_ranks(_observe, 2, action_root, str(inputs), str(reports), timeout=900)[0], reports


def _observe_four(rank: int, world: int, root: str, inputs: str, reports: str) -> dict:
    """4 ranks: CFG 2 x Ulysses 2, one request on all four."""
    both = ("--cfg-parallel", "--ulysses", "2")
    with mock.patch.dict(os.environ, {"RANK": str(rank), "WORLD_SIZE": str(world)}):
        return {mode: _launch(root, inputs, Path(reports, f"four-{mode}"), mode, *both, rank=rank) for mode in MODES}


@pytest.fixture(scope="module")
def observed_four(action_root, inputs, tmp_path_factory):
    reports = tmp_path_factory.mktemp("action-reports-four")
    return run_ranks(_observe_four, 4, action_root, str(inputs), str(reports), timeout=900)[0]


def _digests(report: dict) -> tuple:
    (row,) = report["outputs"]
    return row["mode"], tuple(row["latent_shape"]), row["latent_sha256"], row.get("actions_sha256")


def test_each_mode_is_named_and_rolls_the_chunk(observed):
    one, _, _ = observed
    for mode in MODES:
        name, shape, _, actions = _digests(one[mode])
        assert name == f"{mode.replace('_', ' ')}, pusht, chunk of 4 actions"
        assert shape == (1, 4, 2, 16, 16)  # 1 + 4 frames: two latent frames of the 64 x 64 content
        assert one[mode]["precision_trace"] == "W8A16 x2" and one[mode]["step_policy"] == "checkpoint"
        assert (actions is None) == (mode == "forward_dynamics")  # only policy / inverse predict actions


def test_the_predicted_actions_are_written_beside_the_video(observed):
    import hashlib

    import numpy as np

    one, _, reports = observed
    for mode in ("policy", "inverse_dynamics"):
        (row,) = one[mode]["outputs"]
        written = np.load(reports / f"one-{mode}.actions.npy")
        assert written.shape == (4, 2) and row["actions_shape"] == [4, 2]
        assert hashlib.sha256(written.astype(np.float32).tobytes()).hexdigest() == row["actions_sha256"]
        assert json.loads((reports / f"one-{mode}.actions.json").read_text()) == written.tolist()
    assert not (reports / "one-forward_dynamics.actions.npy").exists()


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_equals_one_rank(observed, layout, mode):
    one, ranks, _ = observed
    assert _digests(ranks[(layout, mode)]) == _digests(one[mode]), (layout, mode)


@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_at_cfg2_x_ulysses2_equals_one_rank(observed, observed_four, mode):
    one, _, _ = observed
    assert _digests(observed_four[mode]) == _digests(one[mode]), mode


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


@pytest.fixture(scope="module")
def server(action_root, demo_cache, tmp_path_factory):
    """The action demo served at CFG 2 on 2 ranks (one server for the module's HTTP tests), each
    rank at this process's thread count, as the launcher's one-rank run here had."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    import torch
    from servers import Ranks

    directory = tmp_path_factory.mktemp("action-serve")
    threads = torch.get_num_threads()
    ranks = Ranks(2, directory, str(demo_cache), "--checkpoint", action_root, "--cfg-parallel", threads=threads)
    yield ranks
    ranks.stop()


# each mode's request: the launcher's options as vLLM-Omni's fields, its upload
SERVED = {
    "forward_dynamics": ({"action": json.dumps(ACTIONS)}, "first.png"),  # a form's field: the rows' JSON text
    "policy": ({}, "first.png"),
    "inverse_dynamics": ({}, "clip.png"),  # the launcher's directory of frames as one animated PNG
}


def test_each_mode_served_over_http_gives_the_launchers_one_rank_digests_and_serves_the_actions(one, server, inputs):
    import hashlib
    import io

    import numpy as np
    from servers import openai_client

    from fsdp_fp8.generation.values import DEFAULT_PROMPT

    client = openai_client(server)
    job = {"action_mode": None, "domain_name": "pusht", "action_chunk_size": 4, "resolution": 256}
    created = {}
    for mode, (fields, upload) in SERVED.items():
        extra = {**job, "action_mode": mode, "num_inference_steps": 2, **fields}
        with open(inputs / upload, "rb") as reference:
            created[mode] = client.videos.create(prompt=DEFAULT_PROMPT, input_reference=reference, extra_body=extra)
    for mode, video in created.items():
        assert client.videos.poll(video.id, poll_interval_ms=200).status == "completed", server.get(
            f"/v1/videos/{video.id}"
        )
        record = server.get(f"/v1/videos/{video.id}")[1]
        (row,) = one[mode]["outputs"]
        digests = ("latent_sha256", "frames_sha256", "actions_sha256", "actions_shape")
        assert {k: record[k] for k in digests} == {k: row.get(k) for k in digests}, mode
        if mode == "forward_dynamics":
            answer = server.get(f"/v1/videos/{video.id}/content?variant=actions")
            assert answer[0] == 404 and "predicted no actions" in answer[1]["error"]["message"]
            continue
        rows = client.videos.download_content(video.id, variant="actions").json()
        npy = np.load(io.BytesIO(client.videos.download_content(video.id, variant="actions_npy").read()))
        assert rows == npy.tolist() and list(npy.shape) == record["actions_shape"]
        assert hashlib.sha256(npy.astype(np.float32).tobytes()).hexdigest() == record["actions_sha256"]
        assert client.videos.download_content(video.id).read()[4:8] == b"ftyp"  # the video: 5 frames, an mp4
    client.videos.delete(created["policy"].id)
    assert not list(Path(server.directory, "out").glob(f"{created['policy'].id}*"))  # its actions too


@pytest.mark.parametrize(
    ("fields", "reasons"),
    [
        (
            {"action_mode": "forward_dynamics", "domain_name": "martian", "chunk_size": 4, "actions": [[1, 2]],
             "num_frames": 5},
            ["--domain 'martian' is not one of diffusers' action domains: ",
             "--action forward_dynamics rolls a first frame forward: give --image (or --video)",
             "leave out --frames"],
        ),
        (
            {"action_mode": "forward_dynamics", "domain_name": "pusht", "chunk_size": 4, "actions": [[1, 2, 3]]},
            ["`actions` has 3 values per action; --domain pusht takes 2"],
        ),
        (
            {"action_mode": "forward_dynamics", "domain_name": "pusht", "chunk_size": 4, "actions": [[1, float("nan")]]},
            ["`actions`: row 0 value 1 is nan; actions must be finite"],
        ),
        (
            {"action_mode": "policy", "domain_name": "pusht", "actions": [[1, 2], [3]]},
            ["--action policy needs --chunk-size", "--actions drives forward_dynamics", "`actions` is ragged"],
        ),
    ],
    ids=["unknown-domain-no-image-frames", "width", "nan", "ragged-and-pairing"],
)  # fmt: skip
def test_careless_action_input_over_http_is_one_400_naming_every_problem(server, fields, reasons):
    status, body, _ = server.post({"prompt": "x", **fields})
    message = body["error"]["message"]
    assert status == 400 and "\n" not in message, body
    for reason in reasons:
        assert reason in message, (reason, message)
    assert "uploads" not in message  # the server's own copy of the actions is never named
