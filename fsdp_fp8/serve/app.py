"""The HTTP side of the server (rank 0): the OpenAI Videos API's routes on FastAPI.

    POST   /v1/videos                 a job (JSON, or multipart with ``input_reference``)
    GET    /v1/videos                 every job;  GET /v1/videos/{id}: one
    GET    /v1/videos/{id}/content    the result: an mp4, or a png for one frame; ?variant=actions
                                      (.json) or actions_npy (.npy): an action job's predicted actions
    DELETE /v1/videos/{id}            cancel a queued or running job; remove a finished one
    GET    /v1/models                 the one model served
    GET    /health                    200 once every rank has loaded; 503 loading, draining, lost
    GET    /metrics                   Prometheus text
    GET    /                          a page to try it (serve/page.html)

Errors answer in the API's shape, ``{"error": {"message", "type", "code"}}``, one line per
problem: 400 for a request the checks refuse, 401 without the key, 404, 409 for content that is
not ready, 413 for a body past ``--max-upload-bytes`` (judged from its length before it is read),
429 with ``Retry-After`` when the queue is full, 503 while not serving.
"""

from __future__ import annotations

import hmac
import importlib.resources
import json
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

from fsdp_fp8.generation.results import actions_paths
from fsdp_fp8.serve import jobs as states
from fsdp_fp8.serve.jobs import JobRecord, JobStore, new_id
from fsdp_fp8.serve.requests import FIELDS, Upload, request_of, request_problems, sniff_upload

RETRY_AFTER_S = 5
# the request's values a job keeps (what the ranks run; its prompt, upload and raw actions are kept beside them)
KEPT_FIELDS = {target for target, _ in FIELDS.values() if target not in ("prompt", "actions")}
KEPT_FIELDS |= {"width", "height", "frames"}
# content variants beside the video: an action job's predicted actions (generation.results.actions_paths)
ACTION_VARIANTS = {"actions": (1, "application/json"), "actions_npy": (0, "application/octet-stream")}


def error(status: int, message: str, code: str, headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": code}}, status, headers=headers)


class Served:
    """What the routes need: the jobs, the ranks' state, the request defaults and checks."""

    def __init__(self, store: JobStore, state, settings, serve_settings, model: str, root, temporal: int, memory):
        self.store, self.state, self.settings, self.serve = store, state, settings, serve_settings
        self.model, self.root, self.temporal, self.memory = model, root, temporal, memory
        self.key: bytes | None = None
        if serve_settings.api_key_file:
            self.key = Path(serve_settings.api_key_file).read_text().strip().encode()


def make_app(served: Served) -> FastAPI:
    app = FastAPI(title="fsdp_fp8", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        refused = _refused(served, request)
        return refused if refused is not None else await call_next(request)

    _service_routes(app, served, _metrics(served))
    _video_routes(app, served)
    return app


def _refused(served: Served, request: Request) -> JSONResponse | None:
    """401 without the key (every route but /health and the page), 413 for a body announced past
    the bound (before a byte of it is read); else None."""
    if served.key is not None and request.url.path not in ("/health", "/"):
        given = request.headers.get("authorization", "")
        token = given[7:].strip().encode() if given.lower().startswith("bearer ") else b""
        if not hmac.compare_digest(token, served.key):
            return error(401, "a valid API key is required: Authorization: Bearer KEY", "invalid_api_key")
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > served.serve.max_upload_bytes):
        limit = served.serve.max_upload_bytes
        return error(413, f"the request body is {length} bytes; this server takes {limit:,} at most", "too_large")
    return None


def _service_routes(app: FastAPI, served: Served, registry: CollectorRegistry) -> None:
    @app.get("/health")
    def health():
        state = served.state
        if state.lost:
            return JSONResponse({"status": "lost", "error": state.lost}, 503)
        if state.draining_since is not None:
            return JSONResponse({"status": "draining"}, 503)
        if not state.ready:
            return JSONResponse({"status": "loading"}, 503)
        return {"status": "ok", "model": served.model, "jobs": served.store.counts()}

    @app.get("/metrics")
    def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    def models():
        return {
            "object": "list",
            "data": [{"id": served.model, "object": "model", "created": 0, "owned_by": "fsdp_fp8"}],
        }

    @app.get("/")
    def page():
        return HTMLResponse(importlib.resources.files("fsdp_fp8.serve").joinpath("page.html").read_text())


def _video_routes(app: FastAPI, served: Served) -> None:
    @app.post("/v1/videos")
    async def create(request: Request):
        if served.state.lost or served.state.draining_since is not None:
            return error(503, "the server is not taking jobs (stopping, or a rank was lost)", "unavailable")
        fields, upload = await _read_body(request, served.serve.max_upload_bytes)
        if isinstance(fields, JSONResponse):
            return fields
        return _create(served, fields, upload)

    @app.get("/v1/videos")
    def listed():
        data = [r.api() for r in served.store.listed()]
        first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
        return {"object": "list", "data": data, "has_more": False, "first_id": first, "last_id": last}

    @app.get("/v1/videos/{job_id}")
    def retrieve(job_id: str):
        record = served.store.get(job_id)
        if record is None:
            return error(404, f"no video job {job_id!r}", "not_found")
        headers = {"openai-poll-after-ms": "500"} if record.status in (states.QUEUED, states.IN_PROGRESS) else None
        return JSONResponse(record.api(), headers=headers)

    @app.get("/v1/videos/{job_id}/content")
    def content(job_id: str, variant: str = "video"):
        record = served.store.get(job_id)
        if record is None:
            return error(404, f"no video job {job_id!r}", "not_found")
        if variant != "video" and variant not in ACTION_VARIANTS:
            kept = ", ".join(["video", *ACTION_VARIANTS])
            return error(400, f"variant {variant!r}: this server keeps {kept}", "unsupported_variant")
        if record.status != states.COMPLETED or not record.output:
            return error(409, f"video job {job_id} is {record.status}; its content exists once completed", "not_ready")
        if variant == "video":
            return FileResponse(served.store.directory / record.output, media_type=record.media_type)
        if not record.actions_sha256:
            return error(404, f"video job {job_id} predicted no actions (only policy and inverse_dynamics do)",
                         "no_actions")  # fmt: skip
        which, media_type = ACTION_VARIANTS[variant]
        return FileResponse(actions_paths(served.store.directory / record.output)[which], media_type=media_type)

    @app.delete("/v1/videos/{job_id}")
    def delete(job_id: str):
        before = served.store.cancel(job_id)
        if before is None:
            return error(404, f"no video job {job_id!r}", "not_found")
        if before == states.IN_PROGRESS:  # stopped by its ranks at their next step boundary
            return {"id": job_id, "object": "video.deleted", "deleted": False, "status": "cancelling"}
        served.store.forget(job_id)
        return {"id": job_id, "object": "video.deleted", "deleted": True}


async def _read_body(request: Request, limit: int):
    """(the fields, the upload or None) of a JSON or multipart body; or an error response."""
    kind = request.headers.get("content-type", "")
    if kind.startswith("multipart/form-data") or kind.startswith("application/x-www-form-urlencoded"):
        try:
            form = await request.form(max_files=1, max_part_size=limit)
        except Exception as exc:  # noqa: BLE001 - a malformed body, a part past the limit
            return error(400, f"the form could not be read: {exc}", "bad_form"), None
        fields, upload = {}, None
        for name, value in form.multi_items():
            if hasattr(value, "read"):
                if name != "input_reference":
                    return error(400, f"a file in `{name}`; the upload is `input_reference`", "bad_form"), None
                data = await value.read(limit + 1)
                if len(data) > limit:
                    return error(413, f"`input_reference` is over {limit:,} bytes", "too_large"), None
                found = sniff_upload(data, Path(value.filename or "").name)
                if isinstance(found, str):
                    return error(400, found, "bad_input_reference"), None
                upload = found
            else:
                fields[name] = value
        return fields, upload
    body = await request.body()
    if len(body) > limit:
        return error(413, f"the request body is over {limit:,} bytes", "too_large"), None
    try:
        fields = json.loads(body or b"{}")
    except ValueError as exc:
        return error(400, f"the body is not JSON: {exc}", "bad_json"), None
    if not isinstance(fields, dict):
        return error(400, "the body must be a JSON object of the request's fields", "bad_json"), None
    return fields, None


def _create(served: Served, fields: dict, upload: Upload | None):
    submission, problems = request_of(fields, upload, served.temporal)
    job_id = new_id()
    saved, actions = None, None
    if submission is not None:
        request = _with_defaults(served, submission)
        uploads = served.store.directory / "uploads"
        if upload is not None:
            saved = uploads / f"{job_id}{upload.suffix}"
            saved.write_bytes(upload.data)
        if submission.actions is not None:  # read by the launcher's reader, as --actions FILE is
            actions = uploads / f"{job_id}.actions.json"
            actions.write_text(json.dumps(submission.actions))
        problems = request_problems(request, served.settings, served.root, saved, actions)
    if problems:
        for path in (saved, actions):
            if path is not None:
                path.unlink(missing_ok=True)
        return error(400, "; ".join(problems), "invalid_request")
    frames = request.frames or (1 + request.chunk_size if request.action else 1)
    one_frame = frames == 1 and not request.sound
    record = JobRecord(
        id=job_id,
        prompt=request.prompt,
        model=served.model,
        size=f"{request.width}x{request.height}" if request.width and request.height else "",
        seconds=f"{frames / request.fps:.3g}",
        created_at=int(time.time()),
        request={k: v for k, v in _request_fields(request).items() if k in KEPT_FIELDS},
        upload=saved.name if saved is not None else None,
        upload_kind=upload.kind if upload is not None else None,
        actions_upload=actions.name if actions is not None else None,
        output=f"{job_id}.{'png' if one_frame else 'mp4'}",
        media_type="image/png" if one_frame else "video/mp4",
    )
    if not served.store.add(record):
        for path in (saved, actions):
            if path is not None:
                path.unlink(missing_ok=True)
        queue = served.store.max_queue
        return error(429, f"{queue} jobs are waiting (--max-queue); try again later", "queue_full",
                     {"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
    return record.api()


def _with_defaults(served: Served, submission):
    """The request with what the served pipeline sets where the request did not: the demo's sizes
    (an action job's come from its chunk and tier), a distilled root's step count and guidance."""
    from fsdp_fp8.generation.loading import demo_sizes, with_schedule

    request = submission.request
    if served.root is None:
        return request if request.action else demo_sizes(request)
    return with_schedule(served.root, request, submission.given)


def _request_fields(request) -> dict:
    import dataclasses

    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(request).items()}


def _metrics(served: Served) -> CollectorRegistry:
    registry = CollectorRegistry()
    jobs = Gauge("fsdp_fp8_jobs", "jobs of this server by status", ["status"], registry=registry)
    for status in (states.QUEUED, states.IN_PROGRESS, states.COMPLETED, states.FAILED, states.CANCELLED):
        jobs.labels(status).set_function(lambda s=status: served.store.counts()[s])
    ready = Gauge("fsdp_fp8_ready", "1 once every rank has loaded and none is lost", registry=registry)
    ready.set_function(lambda: float(served.state.ready and not served.state.lost))
    held = Gauge("fsdp_fp8_rank0_tensor_bytes", "tensor bytes rank 0 holds (CUDA: allocated)", registry=registry)
    held.set_function(lambda: float(served.memory()))
    return registry


__all__ = ["Served", "make_app"]
