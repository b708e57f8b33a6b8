"""The launcher's options become frozen values once (``fsdp_fp8.generation.values``): every option is one
field of one value, classified in the "used by" table and documented; nothing below ``cli/``
takes an argparse ``Namespace``; a pipeline's transformer config is read once by the checks."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path
from unittest import mock

import pytest

from fsdp_fp8.generation.declare import option

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fsdp_fp8"


def _dests() -> set[str]:
    from fsdp_fp8.cli.arguments import build_run_parser

    return {a.dest for a in build_run_parser()._actions if a.dest != "help"}


def test_every_option_is_one_declared_field():
    from fsdp_fp8.generation.declare import declared
    from fsdp_fp8.generation.values import VALUE_CLASSES, value_fields

    assert _dests() == set(value_fields()) == {name for name, _, _ in declared(*VALUE_CLASSES)}


def _usage_reference() -> str:
    usage = (ROOT / "docs" / "usage.md").read_text()
    begin, end = "<!-- options:begin -->\n", "<!-- options:end -->"
    return usage[usage.index(begin) + len(begin) : usage.index(end)]


def test_the_option_reference_of_usage_md_is_made_from_the_declarations():
    from fsdp_fp8.cli.arguments import option_reference

    assert _usage_reference().strip() == option_reference().strip(), (
        "docs/usage.md's option reference differs from the declarations (fsdp_fp8/generation/values.py); "
        "paste `python -c 'from fsdp_fp8.cli.arguments import option_reference; print(option_reference())'` "
        "between its options markers"
    )


@dataclasses.dataclass(frozen=True)
class _WithANewOption:
    """A value class with one option more, declared the one way (a field)."""

    brand_new: int = option(3, "a brand-new knob (default 3)", "reporting", "pipeline", bound=(1, 5), type=int)


def test_one_declared_field_is_an_option_everywhere(tmp_path):
    """The parser, the bounds check, --help's bounds, the "used by" table and the doc's reference
    all take a new option from its field alone."""
    from fsdp_fp8.cli.arguments import build_run_parser, option_reference
    from fsdp_fp8.generation.declare import bound_problems, bounds_text, uses
    from fsdp_fp8.generation.values import VALUE_CLASSES

    classes = (*VALUE_CLASSES, _WithANewOption)
    parser = build_run_parser(classes=classes)
    args = parser.parse_args(["--brand-new", "9"])
    assert args.brand_new == 9 and parser.parse_args([]).brand_new == 3
    assert bound_problems(args, *classes) == ["--brand-new must be <= 5, got 9"]
    assert "--brand-new 1..5" in bounds_text(*classes) and "--brand-new 1..5" in parser.format_help()
    assert "brand_new" in uses("pipeline", *classes) and "brand_new" not in uses("mot", *classes)
    assert "| `--brand-new` | `3` | a brand-new knob (default 3) |" in option_reference(classes)
    assert "brand-new" not in option_reference()


def test_the_job_is_frozen_and_carries_every_value(tmp_path):
    from fsdp_fp8.cli.arguments import job_of, parse_run_args

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
