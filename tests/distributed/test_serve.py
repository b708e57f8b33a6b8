"""``python -m fsdp_fp8 serve`` end to end: two ranks started as torchrun starts them (its
environment, one process each), driven by the official ``openai`` client and a real browser.

Every job's digests are held against the library's own run of the same values in one process
(``fsdp_fp8.generate``, the launcher's engine; test_engine and test_launcher hold that equal to the
launcher at every layout), one intra-op thread as the ranks have. Two ranks with no CFG-parallel or
Ulysses make two request groups: the jobs run two at a time.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from calibration import bound
from servers import ROOT, Ranks, openai_client

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

STEPS = 2


def _inputs(directory: Path) -> dict[str, Path]:
    from PIL import Image

    still = directory / "still.png"
    Image.new("RGB", (48, 40), (200, 40, 40)).save(still)
    import imageio.v2 as imageio
    import numpy as np

    clip = directory / "clip.mp4"
    imageio.mimwrite(clip, [np.full((48, 64, 3), 30 * i, np.uint8) for i in range(5)], fps=24, macro_block_size=16)
    return {"still": still, "clip": clip}


# name -> (request fields, input_reference or None); every one runs STEPS steps
JOBS = {
    "text": ({"seed": 3}, None),
    "image": ({"seed": 4}, "still"),
    "video": ({"seed": 5}, "clip"),
    "sound": ({"seed": 6, "generate_sound": True}, None),
}


def _reference(demo_root: Path, inputs: dict[str, Path]) -> dict[str, dict]:
    """Each job's digests from ``fsdp_fp8.generate`` in this process, at one thread."""
    import torch

    from fsdp_fp8 import GenerationRequest, generate, load_pipeline
    from fsdp_fp8.generation.loading import demo_sizes

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipe = load_pipeline(str(demo_root))
        out = {}
        for name, (fields, upload) in JOBS.items():
            kind = {"still": "image", "clip": "video"}.get(upload)
            values = dict(
                prompt=f"a {name} job", steps=STEPS, seed=fields["seed"], sound=bool(fields.get("generate_sound"))
            )
            if kind:
                values[kind] = str(inputs[upload])
            (result,) = generate(pipe, demo_sizes(GenerationRequest(**values)))
            out[name] = {k: getattr(result, k) for k in ("latent_sha256", "frames_sha256", "sound_sha256")}
        return out
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(demo_root, tmp_path_factory):
    directory = tmp_path_factory.mktemp("serve")
    ranks = Ranks(2, directory, str(demo_root.parent), "--drain-s", "2")
    yield ranks
    ranks.stop()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return _inputs(tmp_path_factory.mktemp("serve-inputs"))


@pytest.fixture(scope="module")
def expected(demo_root, inputs):
    return _reference(demo_root, inputs)


def _client(server) -> openai.OpenAI:
    return openai_client(server)


def test_the_openai_client_runs_every_job_kind_and_each_gives_the_one_process_digests(server, inputs, expected):
    client = _client(server)
    created = {}
    for name, (fields, upload) in JOBS.items():
        extra = {"num_inference_steps": STEPS, **fields}
        reference = inputs[upload].open("rb") if upload else openai.omit
        created[name] = client.videos.create(prompt=f"a {name} job", input_reference=reference, extra_body=extra)
        assert created[name].status == "queued" and created[name].object == "video"
    done = {name: client.videos.poll(video.id, poll_interval_ms=200) for name, video in created.items()}
    records = {name: server.get(f"/v1/videos/{video.id}")[1] for name, video in done.items()}
    for name, record in records.items():
        assert record["status"] == "completed", record
        assert record["progress"] == 100 and record["steps_run"] == STEPS
        assert {k: record[k] for k in expected[name]} == expected[name], name
    assert all(r["phase_seconds"]["denoise"] > 0 for r in records.values())  # every record carries its phases
    content = client.videos.download_content(done["text"].id).read()
    assert content[:8] == b"\x89PNG\r\n\x1a\n"  # one frame: a png
    sound = client.videos.download_content(done["sound"].id).read()
    assert sound[4:8] == b"ftyp"  # an mp4 with its track
    assert client.videos.delete(done["text"].id).deleted
    assert server.get(f"/v1/videos/{done['text'].id}")[0] == 404


def test_the_openai_example_of_usage_md_runs_as_written(server, inputs, tmp_path, monkeypatch):
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "usage.md").read_text(), re.S)
                if "openai.OpenAI(" in b]  # fmt: skip
    block = block.replace("http://127.0.0.1:8000", server.url)
    for name, path in (("still.png", inputs["still"]), ("clip.mp4", inputs["clip"])):
        block = block.replace(f'"{name}"', repr(str(path)))
    monkeypatch.chdir(tmp_path)
    create = openai.resources.videos.Videos.create

    def at_demo_steps(self, **kwargs):  # the demo's 2 steps for every job, not a real model's default
        return create(
            self, **{**kwargs, "extra_body": {"num_inference_steps": STEPS, **(kwargs.get("extra_body") or {})}}
        )

    monkeypatch.setattr(openai.resources.videos.Videos, "create", at_demo_steps)
    namespace: dict = {}
    exec(block, namespace)
    assert namespace["video"].status == "completed"
    assert (tmp_path / "rain.mp4").read_bytes()[4:8] == b"ftyp"


def test_two_jobs_queued_at_once_run_on_the_two_request_groups_together(server):
    """Both are in progress at once (one per group) and each keeps the digest it has alone."""
    client = _client(server)
    # a job of other steps first: the two below cannot join its round, they queue behind it
    client.videos.create(prompt="before", extra_body={"num_inference_steps": 6})
    a = client.videos.create(prompt="first", extra_body={"num_inference_steps": 3, "seed": 11})
    b = client.videos.create(prompt="second", extra_body={"num_inference_steps": 3, "seed": 12})
    together = False
    deadline = time.monotonic() + bound(120)
    while time.monotonic() < deadline:
        states = [client.videos.retrieve(v.id).status for v in (a, b)]
        together |= states == ["in_progress", "in_progress"]
        if all(s in ("completed", "failed") for s in states):
            break
        time.sleep(0.05)
    assert together
    alone = client.videos.poll(
        client.videos.create(prompt="second", extra_body={"num_inference_steps": 3, "seed": 12}).id
    )
    assert (
        server.get(f"/v1/videos/{b.id}")[1]["latent_sha256"] == server.get(f"/v1/videos/{alone.id}")[1]["latent_sha256"]
    )
    assert server.get(f"/v1/videos/{a.id}")[1]["latent_sha256"] != server.get(f"/v1/videos/{b.id}")[1]["latent_sha256"]


BAD = [
    ({"prompt": ""}, "`prompt` is required"),
    ({"prompt": "x", "num_inference_steps": "many"}, "`num_inference_steps` must be an integer, got 'many'"),
    ({"prompt": "x", "size": "big"}, "`size` must be WIDTHxHEIGHT"),
    ({"prompt": "x", "width": 33, "height": 32}, "--width 33"),
    ({"prompt": "x", "seconds": -1}, "`seconds` must be a number above 0"),
    ({"prompt": "x", "colour": "red"}, "unknown field `colour`"),
    ({"prompt": "x", "num_inference_steps": 0}, "--steps"),
    ({"prompt": "x", "condition_keep": "last"}, "give a --video too"),
]


@pytest.mark.parametrize(("fields", "message"), BAD, ids=[m[:24] for _, m in BAD])
def test_a_bad_request_is_a_400_with_the_launchers_words_and_the_server_goes_on(server, fields, message):
    status, body, _ = server.post(fields)
    assert status == 400 and message in body["error"]["message"], body
    assert "\n" not in body["error"]["message"]
    assert server.get("/health")[0] == 200


def test_a_body_past_the_bound_a_bad_upload_and_unknown_ids_are_refused(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=bound(30))
    connection.putrequest("POST", "/v1/videos")
    connection.putheader("content-type", "application/json")
    connection.putheader("content-length", str(65 << 20))  # announced, never sent: judged before reading
    connection.endheaders()
    answer = connection.getresponse()
    assert answer.status == 413 and "this server takes" in json.loads(answer.read())["error"]["message"]
    connection.close()
    boundary = "xyz"
    form = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nx\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="input_reference"; filename="a.txt"\r\n'
        f"Content-Type: text/plain\r\n\r\nnot an image\r\n--{boundary}--\r\n"
    ).encode()
    status, body, _ = server.post(form, f"multipart/form-data; boundary={boundary}")
    assert status == 400 and "is neither an image" in body["error"]["message"]
    for job_id in ("video_" + "0" * 32, "../../etc/passwd", "video_x"):
        assert server.get(f"/v1/videos/{job_id}")[0] == 404
    assert server.get("/health")[0] == 200


def test_the_page_submits_shows_progress_plays_the_result_and_cancels_a_queued_job(server, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api")
    browser_path = next((p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser") if Path(p).exists()), None)
    if browser_path is None:
        pytest.skip("no browser: apt-get install chromium (Debian's package; .ci/run installs it)")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        page = browser.new_page()
        page.goto(server.url + "/")
        page.fill("#prompt", "a page job")
        page.fill("#num_inference_steps", "2")
        page.click("#submit")
        first = page.locator("tr[data-status]").first
        page.wait_for_selector("tr[data-status=completed] .result", timeout=bound(90) * 1000)
        assert page.locator("tr[data-status=completed] progress").first.evaluate("e => e.value") == 100
        # a queued job: long ones fill both groups for rounds to come, the last waits behind them and
        # is cancelled from the page: its own row's button, found by its id (a "first queued row"
        # found again at the click may be another job's; a job one round from the front may have
        # started by the click on a busy machine)
        for seed in (1, 2, 3, 4, 5, 6):
            page.fill("#num_inference_steps", "400")
            page.fill("#seed", str(seed))
            page.click("#submit")
        # every job listed (a click on #submit returns before its POST is answered); the newest row
        # is on top: the last job, queued behind the others
        wait = "n => document.querySelectorAll('tr[data-status]').length >= n"
        page.wait_for_function(wait, arg=7, timeout=bound(30) * 1000)
        newest = page.locator("tr[data-status]").first
        job = newest.get_attribute("data-job")
        assert newest.get_attribute("data-status") == "queued", page.content()
        page.locator(f'tr[data-job="{job}"] .cancel').click()
        page.wait_for_selector(f'tr[data-job="{job}"]', state="detached", timeout=bound(30) * 1000)
        page.screenshot(path=os.environ.get("FSDP_FP8_PAGE_SCREENSHOT", str(tmp_path / "page.png")))
        browser.close()
    assert first is not None
    for record in server.get("/v1/videos")[1]["data"]:  # the long ones are cancelled too
        if record["status"] in ("queued", "in_progress"):
            urllib.request.urlopen(urllib.request.Request(f"{server.url}/v1/videos/{record['id']}", method="DELETE"))


def test_sigterm_drains_and_every_rank_exits_zero(server):
    """Last in this module: a running job is cancelled past the grace, the queued one dropped."""
    client = _client(server)
    client.videos.create(prompt="long", extra_body={"num_inference_steps": 400})
    for p in server.procs:
        p.send_signal(signal.SIGTERM)
    assert server.exits(bound(90)) == [0, 0], server.log()
    assert "stopped:" in server.log()


def test_a_lost_rank_fails_the_jobs_naming_it_and_every_process_exits_non_zero(demo_root, tmp_path):
    ranks = Ranks(2, tmp_path, str(demo_root.parent))
    try:
        client = _client(ranks)
        running = client.videos.create(prompt="long", extra_body={"num_inference_steps": 400})
        queued = client.videos.create(prompt="waiting", extra_body={"num_inference_steps": 5})
        deadline = time.monotonic() + bound(60)
        # past its first steps (progress 2 + 93 * step // 400: 3 from step 5), few of them W8A8 (CPU's slow
        # torch._scaled_mm: steps 3 to 396 under the demo's policy)
        while client.videos.retrieve(running.id).progress < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        ranks.procs[1].kill()
        lost = None
        while lost is None and time.monotonic() < deadline + bound(60):
            try:
                status, body = ranks.get("/health")
                lost = body if status == 503 else None
            except OSError:
                break  # gone already
            time.sleep(0.1)
        codes = ranks.exits(bound(120))
        assert codes[0] not in (None, 0) and codes[1] is not None, codes
        assert lost is not None and "rank 1" in lost["error"], lost
        for job in (running, queued):
            record = json.loads((tmp_path / "out" / f"{job.id}.json").read_text())
            assert record["status"] == "failed" and "rank 1" in record["error"]["message"], record
    finally:
        ranks.stop()


@pytest.mark.parametrize("layout", [["--cfg-parallel"], ["--ulysses", "2"]], ids=["cfg2", "ulysses2"])
def test_a_request_on_two_ranks_of_one_request_gives_the_one_process_digests(demo_root, tmp_path, expected, layout):
    ranks = Ranks(2, tmp_path, str(demo_root.parent), *layout)
    try:
        client = _client(ranks)
        video = client.videos.create(prompt="a text job", extra_body={"num_inference_steps": STEPS, "seed": 3})
        assert client.videos.poll(video.id, poll_interval_ms=200).status == "completed"
        record = ranks.get(f"/v1/videos/{video.id}")[1]
        assert {k: record[k] for k in expected["text"]} == expected["text"]
    finally:
        ranks.stop()
