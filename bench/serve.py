"""What the server saves and what it costs, on the embedded demo, in one run (ratios):

- N requests through one server (its start and load included) against N launcher runs of the
  same requests (each a whole process: start, load, generate, exit);
- the server's own cost per request: the time from POST to a completed record, against the
  same request's ``fsdp_fp8.generate`` call in one process (the pipeline loaded once);
- the time from POST to the job's first step.

    python -m bench.serve [--requests 4] [--steps 2] [--repeats 3]

One process each (no torchrun), one intra-op thread, medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench import harness

ROOT = harness.ROOT
ENV = harness.repo_env(OMP_NUM_THREADS="1")


def _launcher_runs(requests: int, steps: int) -> float:
    started = time.perf_counter()
    for seed in range(requests):
        command = [sys.executable, str(ROOT / "launch" / "infer.py"), "--prompt", "a red fox", "--steps", str(steps)]
        subprocess.run([*command, "--seed", str(seed)], env=ENV, check=True, capture_output=True)
    return time.perf_counter() - started


def _call(url: str, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def _server_runs(requests: int, steps: int, directory: Path) -> tuple[float, list[float], list[float]]:
    """(the whole: start, load, every request, in turn; each request's POST to completed; each
    request's POST to its first step)."""
    started = time.perf_counter()
    log = directory / "serve.log"
    command = [sys.executable, "-m", "fsdp_fp8", "serve", "--port", "0", "--output-dir", str(directory / "out")]
    with log.open("w") as out:
        server = subprocess.Popen(command, env=ENV, stdout=out, stderr=subprocess.STDOUT)
    try:
        while not (found := re.search(r"on http://127\.0\.0\.1:(\d+)", log.read_text())):
            if server.poll() is not None:
                raise SystemExit(log.read_text())
            time.sleep(0.02)
        url = f"http://127.0.0.1:{found.group(1)}"
        each, first = [], []
        for seed in range(requests):
            posted = time.perf_counter()
            job = _call(url, "/v1/videos", {"prompt": "a red fox", "num_inference_steps": steps, "seed": seed})
            stepped = None
            while (record := _call(url, f"/v1/videos/{job['id']}"))["status"] not in ("completed", "failed"):
                if stepped is None and record["steps_run"] >= 1:
                    stepped = time.perf_counter() - posted
                time.sleep(0.005)
            each.append(time.perf_counter() - posted)
            first.append(stepped if stepped is not None else each[-1])
        return time.perf_counter() - started, each, first
    finally:
        server.terminate()
        server.wait(60)


def _direct_calls(requests: int, steps: int) -> list[float]:
    """Each request as one ``generate`` call, the pipeline loaded once in this process."""
    import torch

    from fsdp_fp8 import GenerationRequest, generate, load_pipeline
    from fsdp_fp8.generation.demo import demo_checkpoint
    from fsdp_fp8.generation.loading import demo_sizes

    torch.set_num_threads(1)
    pipe = load_pipeline(str(demo_checkpoint()))
    seconds = []
    for seed in range(requests):
        started = time.perf_counter()
        generate(pipe, demo_sizes(GenerationRequest(prompt="a red fox", steps=steps, seed=seed)))
        seconds.append(time.perf_counter() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import tempfile

    launcher, server, per_request, first_step, direct = [], [], [], [], []
    for repeat in range(args.repeats):  # interleaved
        launcher.append(_launcher_runs(args.requests, args.steps))
        with tempfile.TemporaryDirectory() as tmp:
            whole, each, first = _server_runs(args.requests, args.steps, Path(tmp))
        server.append(whole)
        per_request += each[1:]  # the first request also pays the process's first-call warm-up
        first_step += first[1:]
        direct += _direct_calls(args.requests, args.steps)[1:]
    med = statistics.median
    figures = {
        "requests": args.requests,
        "steps": args.steps,
        "launcher_runs_s": round(med(launcher), 3),
        "one_server_s": round(med(server), 3),
        "launcher_over_server": round(med(launcher) / med(server), 2),
        "server_request_s": round(med(per_request), 4),
        "direct_call_s": round(med(direct), 4),
        "server_over_direct": round(med(per_request) / med(direct), 2),
        "post_to_first_step_s": round(med(first_step), 4),
    }
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
