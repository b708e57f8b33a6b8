"""A served pipeline for the tests: ``python -m fsdp_fp8 serve`` on N ranks started as torchrun
starts them (its environment, one process each, a free port), rank 0's port read from its log,
and the official ``openai`` client on it. One server per test module (a module fixture): each
start pays the whole load."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from calibration import bound

ROOT = Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"serving \S+ on http://127\.0\.0\.1:(\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """``world`` server ranks with torchrun's environment; rank 0's port once it listens.
    ``threads``: each rank's intra-op threads (torchrun's default, 1, unless the digests are held
    against a run at another count: the denoising's CPU reductions split by thread)."""

    def __init__(self, world: int, directory: Path, cache: str, *args: str, threads: int = 1) -> None:
        self.directory, self.logs, self.procs = directory, [], []
        master = free_port()
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
            env |= dict(LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master))
            env |= dict(OMP_NUM_THREADS=str(threads), FSDP_FP8_CACHE=cache, PYTHONPATH=str(ROOT))
            log = directory / f"rank{rank}.log"
            self.logs.append(log)
            command = [sys.executable, "-m", "fsdp_fp8", "serve", "--port", "0", "--output-dir", str(directory / "out")]
            with log.open("w") as out:
                self.procs.append(subprocess.Popen([*command, *args], stdout=out, stderr=subprocess.STDOUT, env=env))
        self.port = self._listening(bound(180))
        self.url = f"http://127.0.0.1:{self.port}"

    def log(self, rank: int = 0) -> str:
        return self.logs[rank].read_text()

    def _listening(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = LISTENING.search(self.log())
            if found:
                return int(found.group(1))
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.2)
        self.stop()
        raise AssertionError(
            "the server did not start:\n" + "\n".join(self.log(r)[-3000:] for r in range(len(self.procs)))
        )

    def get(self, path: str) -> tuple[int, dict | bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=bound(30)) as r:
                body = r.read()
                return r.status, json.loads(body) if r.headers.get_content_type() == "application/json" else body
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def post(self, fields: dict | bytes, content_type: str = "application/json", headers=None):
        data = fields if isinstance(fields, bytes) else json.dumps(fields).encode()
        request = urllib.request.Request(self.url + "/v1/videos", data=data, method="POST")
        request.add_header("content-type", content_type)
        for key, value in (headers or {}).items():
            request.add_header(key, value)
        try:
            with urllib.request.urlopen(request, timeout=bound(30)) as r:
                return r.status, json.loads(r.read()), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), dict(e.headers)

    def exits(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def openai_client(server):
    """The official client on ``server`` (no retries: a refusal is the answer under test)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


__all__ = ["LISTENING", "ROOT", "Ranks", "free_port", "openai_client"]
