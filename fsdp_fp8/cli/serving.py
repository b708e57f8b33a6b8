"""``torchrun --nproc-per-node N -m fsdp_fp8 serve [options]``: the server's options parsed and
checked before torch loads (a usage error exits 2 on rank 0 alone, as the launcher's), then
``fsdp_fp8.serve.main.serve``. The launcher's layout options are its own declarations
(``serve.settings.SHARED``); another address than this machine's needs an API key.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from fsdp_fp8.cli.arguments import RankZeroParser, add_option
from fsdp_fp8.generation.checks import value_problems
from fsdp_fp8.generation.declare import bound_problems, declared, take
from fsdp_fp8.generation.inputs import checkpoint_problems
from fsdp_fp8.generation.values import RunSettings
from fsdp_fp8.serve.settings import LOOPBACK, MIN_KEY_CHARACTERS, SHARED, ServeSettings

SERVE_EXTRA = ("fastapi", "uvicorn", "prometheus_client", "multipart")  # the serve extra's modules


def build_serve_parser(prog: str) -> argparse.ArgumentParser:
    parser = RankZeroParser(
        prog=prog,
        description="Load a pipeline once over the ranks and serve it over HTTP (the OpenAI Videos API); "
        "rank 0 listens. Without --checkpoint it serves the embedded demo.",
    )
    shared = parser.add_argument_group("what to load and how (as the launcher's options)")
    for name in SHARED:
        add_option(shared, name)
    serving = parser.add_argument_group("serving")
    for name, _, _ in declared(ServeSettings):
        add_option(serving, name, (ServeSettings,))
    return parser


def parse_serve_args(argv: list[str], prog: str) -> tuple[RunSettings, ServeSettings]:
    """The settings, every value checked, or one usage error (exit 2)."""
    parser = build_serve_parser(prog)
    args = parser.parse_args(argv)
    settings = RunSettings(**take(RunSettings, args, lambda v: tuple(v) if isinstance(v, list) else v))
    serve = ServeSettings(**take(ServeSettings, args))
    problems = value_problems(settings) + bound_problems(serve, ServeSettings)
    if settings.checkpoint:
        problems += checkpoint_problems("--checkpoint", settings.checkpoint)[1]
    if serve.host not in LOOPBACK and serve.api_key_file is None:
        problems.append(f"--host {serve.host} listens beyond this machine; give --api-key-file too")
    if serve.api_key_file is not None:
        problems += _key_problems(serve.api_key_file)
    if problems:
        parser.error("; ".join(sorted(set(problems))))
    return settings, serve


def _key_problems(path: str) -> list[str]:
    try:
        key = Path(path).read_text().strip()
    except OSError as exc:
        return [f"--api-key-file {path}: cannot be read: {exc.strerror or exc}"]
    if len(key) < MIN_KEY_CHARACTERS:
        return [f"--api-key-file {path}: the key is {len(key)} characters; use {MIN_KEY_CHARACTERS} or more"]
    return []


def main(argv: list[str], prog: str = "fsdp-fp8 serve") -> int:
    settings, serve = parse_serve_args(argv, prog)
    from fsdp_fp8.cli.quiet import quiet_third_party

    missing = [name for name in SERVE_EXTRA if importlib.util.find_spec(name) is None]
    if missing:  # before the load: the HTTP side would fail only once every rank has loaded
        RankZeroParser(prog=prog).error(
            f"serving needs {', '.join(missing)}: pip install 'fsdp-fp8[serve]' (FastAPI, uvicorn, "
            "prometheus-client, python-multipart)"
        )
    from fsdp_fp8.serve.main import serve as run_server

    quiet_third_party()
    return run_server(settings, serve)


__all__ = ["build_serve_parser", "main", "parse_serve_args"]
