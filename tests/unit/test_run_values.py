"""The launcher's options become frozen values once (``fsdp_fp8.cli.request``): every option is one
field of one value, classified in the "used by" table and documented; nothing below ``cli/``
takes an argparse ``Namespace``; a pipeline's transformer config is read once by the checks."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fsdp_fp8"


def _dests() -> set[str]:
    from fsdp_fp8.cli.arguments import build_run_parser

    return {a.dest for a in build_run_parser()._actions if a.dest != "help"}


def unclassified_options() -> list[str]:
    """Options of ``launch/infer.py`` missing from a value, the "used by" table or docs/usage.md."""
    from fsdp_fp8.cli.options import EVERY_KIND, USES
    from fsdp_fp8.cli.request import value_fields

    used = set().union(*USES.values()) | EVERY_KIND
    usage = (ROOT / "docs" / "usage.md").read_text()
    problems = []
    for dest in sorted(_dests()):
        flag = "--" + dest.replace("_", "-")
        if dest not in value_fields():
            problems.append(f"{flag}: no field of GenerationRequest / RunSettings (fsdp_fp8/cli/request.py)")
        if dest not in used:
            problems.append(f"{flag}: in neither options.USES nor options.EVERY_KIND")
        if f"`{flag}" not in usage:
            problems.append(f"{flag}: not in docs/usage.md")
    return problems


def test_every_option_is_a_field_classified_and_documented():
    assert unclassified_options() == []


def test_an_option_added_to_the_parser_alone_is_named(monkeypatch):
    from fsdp_fp8.cli import arguments

    group = dict(arguments.OPTIONS)
    group["reporting"] = [*group["reporting"], (("--brand-new",), dict(help="x"))]
    monkeypatch.setattr(arguments, "OPTIONS", group)
    assert unclassified_options() == [
        "--brand-new: no field of GenerationRequest / RunSettings (fsdp_fp8/cli/request.py)",
        "--brand-new: in neither options.USES nor options.EVERY_KIND",
        "--brand-new: not in docs/usage.md",
    ]


def test_the_values_have_no_field_that_is_no_option():
    from fsdp_fp8.cli.request import value_fields

    assert set(value_fields()) == _dests()


def test_the_job_is_frozen_and_carries_every_value(tmp_path):
    from fsdp_fp8.cli.arguments import parse_run_args
    from fsdp_fp8.cli.request import job_of

    args = parse_run_args(["--steps", "3", "--prompt-ids", "1,2", "--report", str(tmp_path / "r.json")])
    job = job_of(args)
    assert job.request.steps == 3 and job.request.prompt_ids == (1, 2)
    assert job.settings.report == str(tmp_path / "r.json")
    assert {"steps", "prompt_ids", "report"} <= job.given
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.request.steps = 4  # type: ignore[misc]
    sized = job.request.with_default_sizes({"num_frames": 1, "height": 32, "width": 48})
    assert sized.sizes() == {"num_frames": 1, "height": 32, "width": 48}


def namespace_uses(relative: Path, source: str) -> list[str]:
    """Where a module below ``cli/`` imports argparse, names ``Namespace`` or reads an attribute of a
    parameter named ``args`` (a Namespace travelling down): ``args.prompt``, not ``args.cos()``."""
    found = []
    tree = ast.parse(source)
    calls = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    for node in ast.walk(tree):
        where = f"fsdp_fp8/{relative.as_posix()}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if "argparse" in names or "Namespace" in names:
                found.append(f"{where}: imports argparse")
        elif isinstance(node, ast.Name | ast.Attribute) and "Namespace" in (
            getattr(node, "id", None),
            getattr(node, "attr", None),
        ):
            found.append(f"{where}: names Namespace")
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "args"
            and id(node) not in calls
        ):
            found.append(f"{where}: reads args.{node.attr}")
    return found


def test_no_module_below_cli_takes_a_namespace():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in ("cli", "__main__.py"):
            continue
        found += namespace_uses(relative, path.read_text())
    assert found == []


def test_the_namespace_rule_sees_a_namespace_travelling_down():
    source = "def run(model, args):\n    return model(args.prompt, args.cos())\n"
    assert namespace_uses(Path("interop/x.py"), source) == ["fsdp_fp8/interop/x.py:2: reads args.prompt"]
    assert namespace_uses(Path("interop/x.py"), "from argparse import Namespace\n") == [
        "fsdp_fp8/interop/x.py:1: imports argparse"
    ]


def test_the_checks_read_the_transformer_config_once(demo_root, tmp_path):
    """--sequence-parallel's heads and the sizes' patch come from one read of the transformer's
    config.json (and a degree it cannot take is still named)."""
    import io
    import os

    from fsdp_fp8.cli.arguments import parse_run_args

    reads = []
    real_os_open, real_io_open = os.open, io.open

    def os_open(path, *args, **kwargs):
        reads.append(Path(path))
        return real_os_open(path, *args, **kwargs)

    def io_open(path, *args, **kwargs):
        reads.append(Path(path) if isinstance(path, str | Path) else path)
        return real_io_open(path, *args, **kwargs)

    env = {"WORLD_SIZE": "2"}
    argv = ["--checkpoint", str(demo_root), "--sequence-parallel", "2", "--report", str(tmp_path / "r.json")]
    with mock.patch("os.open", os_open), mock.patch("io.open", io_open), mock.patch.dict("os.environ", env):
        parse_run_args(argv)
    config = demo_root / "transformer" / "config.json"
    assert reads.count(config) == 1, reads
    heads = json.loads(config.read_text())["num_attention_heads"]
    with mock.patch.dict("os.environ", {"WORLD_SIZE": str(2 * heads)}), pytest.raises(SystemExit):
        parse_run_args(["--checkpoint", str(demo_root), "--sequence-parallel", str(2 * heads)])
