"""Action jobs from the launcher on the action demo (the demo with an ``action_gen`` transformer,
a ModelOpt FP8 export with the published step policy): forward dynamics, policy and inverse
dynamics, each latent and each predicted actions' digest at 2 ranks (FSDP), CFG 2, Ulysses 2 and
(4 ranks) CFG 2 x Ulysses 2 equal to one rank's, the action tokens exchanged by the CFG pair and
split by the Ulysses group like the other modalities; the predicted actions written beside the
video; the report names the mode; careless input refused before the load. The same jobs served
over HTTP (``serve`` at CFG 2 on 2 ranks, the official ``openai`` client) give the launcher's
one-rank digests and serve the predicted actions; careless input there is one 400 naming every
problem.

The same spawns run a root of the real ModelOpt 0.47 action fixture (tests/fixtures/
``modelopt-0.47-cosmos3-action-transformer``, calibrated through diffusers' own pipeline on each
action mode, given the published step policy) beside the action demo's other components: every
mode on one rank, and each mode at one more layout (``FIXTURE_LAYOUTS``: each layout once, policy
also at CFG 2 x Ulysses 2), the one-rank digests of that root. The demo runs every mode at every
layout; the fixture's modes over the layouts again would add a third of the module's time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest

pytest.importorskip("diffusers")
pytestmark = pytest.mark.timeout(900)

from pipelines import ACTION_FIXTURE  # noqa: E402
from ranks import run_ranks  # noqa: E402

LAYOUTS = {"fsdp": (), "cfg": ("--cfg-parallel",), "ulysses": ("--ulysses", "2")}
ROOTS = ("demo", "fixture")  # the action demo; the ModelOpt fixture beside its other components
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
# The fixture root's layout at 2 ranks for each mode (every mode, every layout on the demo), and
# its mode at 4 ranks (CFG 2 x Ulysses 2): the modes that predict actions where the action tokens
# are exchanged (CFG) and split (Ulysses)
FIXTURE_LAYOUTS = {"forward_dynamics": "fsdp", "policy": "cfg", "inverse_dynamics": "ulysses"}
FIXTURE_MODES_AT_FOUR = ("policy",)
AT_TWO = [("demo", layout, mode) for layout in LAYOUTS for mode in MODES]
AT_TWO += [("fixture", layout, mode) for mode, layout in FIXTURE_LAYOUTS.items()]
AT_FOUR = [("demo", mode) for mode in MODES] + [("fixture", mode) for mode in FIXTURE_MODES_AT_FOUR]


def _launch(root: str, inputs: str, out: Path, mode: str, *extra: str, rank: int = 0) -> dict | None:
    """One launcher run of ``mode``; its report (rank 0). The video (and the predicted actions)
    go to ``out``.png."""
    from fsdp_fp8.cli.runner import main

    job = ["--action", mode, "--domain", "pusht", "--chunk-size", "4", "--resolution-tier", "256"]
    job += [str(Path(inputs, a)) if a in ("actions.json", "first.png", "clip") else a for a in MODES[mode]]
    job += ["--output", f"{out}.png", "--report", f"{out}.json"]
    assert main(["--checkpoint", root, *job, "--steps", "2", *extra]) == 0
    return json.loads(Path(f"{out}.json").read_text()) if rank == 0 else None


@pytest.fixture(scope="module")
def roots(action_root, tmp_path_factory) -> dict[str, str]:
    """The action demo, and a root of the ModelOpt action fixture beside its other components."""
    from pipelines import pipeline_beside_the_demo

    fixture = pipeline_beside_the_demo(
        Path(action_root), tmp_path_factory.mktemp("action-fixture") / "root", ACTION_FIXTURE
    )
    return {"demo": action_root, "fixture": fixture}


def _observe(rank: int, world: int, roots: dict, inputs: str, reports: str) -> dict:
    with mock.patch.dict(os.environ, {"RANK": str(rank), "WORLD_SIZE": str(world)}):
        return {
            (name, layout, mode): _launch(
                roots[name], inputs, Path(reports, f"{name}-{layout}-{mode}"), mode, *LAYOUTS[layout], rank=rank
            )
            for name, layout, mode in AT_TWO
        }


@pytest.fixture(scope="module")
def one_rank(roots, inputs, tmp_path_factory):
    """One rank's reports (``one[root][mode]``) and the reports' folder."""
    reports = tmp_path_factory.mktemp("action-reports")
    one = {
        name: {mode: _launch(root, str(inputs), reports / f"one-{name}-{mode}", mode) for mode in MODES}
        for name, root in roots.items()
    }
    return one, reports


@pytest.fixture(scope="module")
def one(one_rank) -> dict:
    """Each mode's report from the launcher on one rank, on the action demo."""
    return one_rank[0]["demo"]


@pytest.fixture(scope="module")
def observed(one_rank, roots, inputs):
    """One rank's reports, 2 ranks' (``ranks[root, layout, mode]``), the reports' folder."""
    one, reports = one_rank
    return one, run_ranks(_observe, 2, roots, str(inputs), str(reports), timeout=900)[0], reports


def _observe_four(rank: int, world: int, roots: dict, inputs: str, reports: str) -> dict:
    """4 ranks: CFG 2 x Ulysses 2, one request on all four."""
    both = ("--cfg-parallel", "--ulysses", "2")
    with mock.patch.dict(os.environ, {"RANK": str(rank), "WORLD_SIZE": str(world)}):
        return {
            (name, mode): _launch(roots[name], inputs, Path(reports, f"four-{name}-{mode}"), mode, *both, rank=rank)
            for name, mode in AT_FOUR
        }


@pytest.fixture(scope="module")
def observed_four(roots, inputs, tmp_path_factory):
    reports = tmp_path_factory.mktemp("action-reports-four")
    return run_ranks(_observe_four, 4, roots, str(inputs), str(reports), timeout=900)[0]


def _digests(report: dict) -> tuple:
    (row,) = report["outputs"]
    return row["mode"], tuple(row["latent_shape"]), row["latent_sha256"], row.get("actions_sha256")


@pytest.mark.parametrize("root", ROOTS)
def test_each_mode_is_named_and_rolls_the_chunk(one_rank, root):
    one = one_rank[0][root]
    for mode in MODES:
        name, shape, _, actions = _digests(one[mode])
        assert name == f"{mode.replace('_', ' ')}, pusht, chunk of 4 actions"
        assert shape == (1, 4, 2, 16, 16)  # 1 + 4 frames: two latent frames of the 64 x 64 content
        assert one[mode]["precision_trace"] == "W8A16 x2" and one[mode]["step_policy"] == "checkpoint"
        assert (actions is None) == (mode == "forward_dynamics")  # only policy / inverse predict actions


def test_the_fixture_root_runs_the_fixture(one_rank):
    """The fixture root loads ModelOpt's 31 FP8 linears (its recipe quantizes ``proj_in`` and
    ``time_embedder``, the demo's export does not), and what each mode generates is not the demo's.
    (Inverse dynamics keeps the clip's latent, the conditioning, and predicts only the actions.)"""
    one = one_rank[0]
    assert {one["fixture"][m]["fp8_linears"] for m in MODES} == {31}
    assert {one["demo"][m]["fp8_linears"] for m in MODES} == {28}
    changed = {}
    for mode in MODES:
        demo, fixture = _digests(one["demo"][mode]), _digests(one["fixture"][mode])
        changed[mode] = (demo[2] != fixture[2], demo[3] != fixture[3])  # (latent, actions)
    assert changed == {"forward_dynamics": (True, False), "policy": (True, True), "inverse_dynamics": (False, True)}


def test_the_predicted_actions_are_written_beside_the_video(one_rank):
    import hashlib

    import numpy as np

    one, reports = one_rank
    for mode in ("policy", "inverse_dynamics"):
        (row,) = one["demo"][mode]["outputs"]
        written = np.load(reports / f"one-demo-{mode}.actions.npy")
        assert written.shape == (4, 2) and row["actions_shape"] == [4, 2]
        assert hashlib.sha256(written.astype(np.float32).tobytes()).hexdigest() == row["actions_sha256"]
        assert json.loads((reports / f"one-demo-{mode}.actions.json").read_text()) == written.tolist()
    assert not (reports / "one-demo-forward_dynamics.actions.npy").exists()


@pytest.mark.parametrize(("root", "layout", "mode"), AT_TWO, ids=["-".join(c) for c in AT_TWO])
def test_each_mode_equals_one_rank(observed, root, layout, mode):
    one, ranks, _ = observed
    assert _digests(ranks[(root, layout, mode)]) == _digests(one[root][mode]), (root, layout, mode)


@pytest.mark.parametrize(("root", "mode"), AT_FOUR, ids=["-".join(c) for c in AT_FOUR])
def test_each_mode_at_cfg2_x_ulysses2_equals_one_rank(observed, observed_four, root, mode):
    one, _, _ = observed
    assert _digests(observed_four[(root, mode)]) == _digests(one[root][mode]), (root, mode)


def test_the_action_fixture_is_modelopts_own_export():
    """What ModelOpt 0.47 wrote (tests/fixtures/make_hf_fixtures.py): its producer and recipe;
    the generation tower FP8 with input scales; the domain-aware action projections (an
    ``nn.Embedding`` of per-domain weights, no ``nn.Linear``) left BF16 under ModelOpt's own
    ``action_proj_in*`` / ``action_proj_out*`` ignore patterns, and loaded as stored."""
    import torch
    from safetensors import safe_open

    from fsdp_fp8 import gather_state_dict, load_model

    config = json.loads((ACTION_FIXTURE / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["producer"] == {"name": "modelopt", "version": "0.47.0"} and quant["quant_method"] == "modelopt"
    assert quant["quant_algo"] == "FP8" and "runtime" not in quant  # ModelOpt writes no step policy
    assert config["action_gen"] is True and config["action_dim"] == 10
    assert {"action_proj_in*", "action_proj_out*"} <= set(quant["ignore"])
    with safe_open(ACTION_FIXTURE / "diffusion_pytorch_model.safetensors", "pt") as files:
        dtypes = {k: files.get_slice(k).get_dtype() for k in files.keys()}  # noqa: SIM118
        stored = {k: files.get_tensor(k) for k in dtypes if k.startswith("action_")}
    assert {k: v for k, v in dtypes.items() if k.startswith("action_")} == {
        "action_modality_embed": "BF16",
        "action_proj_in.bias.weight": "BF16",
        "action_proj_in.fc.weight": "BF16",
        "action_proj_out.bias.weight": "BF16",
        "action_proj_out.fc.weight": "BF16",
    }
    generation = [k.removesuffix(".weight") for k in dtypes if ".mlp_moe_gen." in k and k.endswith(".weight")]
    assert generation and all(
        dtypes[f"{n}.weight"] == "F8_E4M3" and dtypes[f"{n}.weight_scale"] == dtypes[f"{n}.input_scale"] == "F32"
        for n in generation
    )
    loaded = load_model(None, ACTION_FIXTURE, device=torch.device("cpu"))
    assert len(loaded.fp8_linears) == 31 and not any(n.startswith("action_") for n in loaded.fp8_linears)
    gathered = gather_state_dict(loaded.model)
    assert all(gathered[k].dtype == torch.bfloat16 and torch.equal(gathered[k], v) for k, v in stored.items())


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
