"""The server's HTTP side alone (no ranks): the key, the full queue, the address refused without
a key. The app is the real one on a real job store; what the ranks do is test_serve.py's."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")


@pytest.fixture
def app_of(tmp_path):
    from starlette.testclient import TestClient

    from fsdp_fp8.generation.values import RunSettings
    from fsdp_fp8.serve.app import Served, make_app
    from fsdp_fp8.serve.jobs import JobStore
    from fsdp_fp8.serve.settings import ServeSettings
    from fsdp_fp8.serve.worker import ServerState

    def make(**serve) -> TestClient:
        settings = ServeSettings(output_dir=str(tmp_path / "out"), **serve)
        store = JobStore(tmp_path / "out", settings.max_queue)
        served = Served(store, ServerState(ready=True), RunSettings(), settings, "demo", None, 4, lambda: 0)
        return TestClient(make_app(served))

    return make


def test_with_a_key_every_route_but_health_and_the_page_needs_it(app_of, tmp_path):
    key = tmp_path / "key"
    key.write_text("k" * 32 + "\n")
    client = app_of(api_key_file=str(key))
    assert client.get("/health").status_code == 200 and client.get("/").status_code == 200
    for path in ("/v1/models", "/v1/videos", "/metrics"):
        refused = client.get(path)
        assert refused.status_code == 401 and "Bearer" in refused.json()["error"]["message"], path
        assert client.get(path, headers={"Authorization": "Bearer " + "k" * 31 + "x"}).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer " + "k" * 32}).status_code == 200, path


def test_a_full_queue_answers_429_with_retry_after_and_keeps_nothing(app_of, tmp_path):
    client = app_of(max_queue=1)
    assert client.post("/v1/videos", json={"prompt": "first"}).status_code == 200
    full = client.post("/v1/videos", json={"prompt": "second"})
    assert full.status_code == 429 and full.headers["retry-after"].isdigit()
    assert "--max-queue" in full.json()["error"]["message"]
    assert [r["prompt"] for r in client.get("/v1/videos").json()["data"]] == ["first"]
    assert sorted(p.name for p in (tmp_path / "out").glob("video_*.json")) == [
        r["id"] + ".json" for r in client.get("/v1/videos").json()["data"]
    ]


def test_an_address_beyond_this_machine_without_a_key_is_refused_at_start(capsys, tmp_path):
    from fsdp_fp8.cli.serving import parse_serve_args

    with pytest.raises(SystemExit) as stop:
        parse_serve_args(["--host", "0.0.0.0"], "serve")
    assert stop.value.code == 2
    assert "--host 0.0.0.0 listens beyond this machine; give --api-key-file too" in capsys.readouterr().err
    short = tmp_path / "short"
    short.write_text("abc")
    with pytest.raises(SystemExit):
        parse_serve_args(["--host", "0.0.0.0", "--api-key-file", str(short)], "serve")
    assert "the key is 3 characters; use 16 or more" in capsys.readouterr().err


def test_the_request_fields_are_the_declarations_per_request_fields():
    """Every field a request may set is declared ``per_request`` (the upload sets image or video)."""
    from fsdp_fp8.generation.declare import declared
    from fsdp_fp8.generation.values import GenerationRequest
    from fsdp_fp8.serve.requests import FIELDS

    per_request = {name for name, _, meta in declared(GenerationRequest) if meta.per_request}
    assert {target for target, _ in FIELDS.values()} | {"image", "video"} == per_request


def test_an_action_request_reads_vllm_omnis_names_and_ours_alike():
    import json

    from fsdp_fp8.serve.requests import request_of

    rows = [[0.1, -0.2], [0.3, 0.0]]
    theirs = {"action_mode": "policy", "domain_name": "pusht", "action_chunk_size": 4, "resolution": 256}
    ours = {"action_mode": "policy", "domain_name": "pusht", "chunk_size": "4", "resolution_tier": "256"}
    (a, none_a), (b, none_b) = (request_of({"prompt": "x", **f, "action": rows}, None, 4) for f in (theirs, ours))
    assert none_a == none_b == [] and a == b
    assert (a.request.action, a.request.domain, a.request.chunk_size, a.request.resolution_tier) == (
        "policy",
        "pusht",
        4,
        256,
    )
    assert a.actions == rows and a.request.actions is None  # kept as a file beside the job, not a value
    in_a_form, _ = request_of({"prompt": "x", "actions": json.dumps(rows)}, None, 4)  # multipart: its JSON text
    assert in_a_form.actions == rows


def test_careless_action_fields_are_one_400_listing_every_problem(app_of, tmp_path):
    client = app_of()
    fields = {"prompt": "x", "action_mode": "walk", "resolution": 300, "actions": "[[1, 2"}
    refused = client.post("/v1/videos", json=fields)
    message = refused.json()["error"]["message"]
    assert refused.status_code == 400, message
    assert "`action_mode` must be one of forward_dynamics, inverse_dynamics, policy, got 'walk'" in message
    assert "`resolution` must be one of 256, 480, 704, 720, got 300" in message
    assert "`actions` must be a list of lists of numbers" in message
    # the demo's transformer takes no actions: named, with what else the request lacks
    policy = {"prompt": "x", "action_mode": "policy", "domain_name": "pusht", "chunk_size": 4, "actions": [[1, 2]]}
    message = client.post("/v1/videos", json=policy).json()["error"]["message"]
    assert "--action: the demo's transformer config has no `action_gen`: its transformer takes no actions" in message
    assert "--action policy rolls a first frame forward: give --image (or --video)" in message
    assert "--actions drives forward_dynamics; --action policy predicts the actions itself" in message
    assert client.get("/v1/videos").json()["data"] == []
    assert list((tmp_path / "out" / "uploads").iterdir()) == []  # the actions kept for the checks: removed


def test_jobs_of_different_action_modes_never_share_a_round():
    """The engine runs a round's jobs as one set of transformer calls (``round_key``): an action
    job's projections only with jobs of its mode."""
    from fsdp_fp8.serve.jobs import JobRecord
    from fsdp_fp8.serve.worker import same_round

    def job(**extra):
        return JobRecord("video_" + "0" * 32, "x", "demo", "", "0", 0, {"steps": 2, "guidance": 3.0} | extra)

    plain, policy, inverse = job(), job(action="policy"), job(action="inverse_dynamics")
    assert same_round(policy, job(action="policy")) and same_round(plain, job())
    assert not same_round(plain, policy) and not same_round(policy, inverse)
