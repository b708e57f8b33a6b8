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
