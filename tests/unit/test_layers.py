"""The package's layers and their direction, held by parsing every module's imports (nothing
is run), those under ``if TYPE_CHECKING:`` included: a type a lower layer names from a higher one
is a back edge too. docs/design.md draws the same picture; change both together."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_fp8"

# layer -> the layers it may import (its own layer is always allowed)
_COMPOSED = {"errors", "format", "reading", "collective", "fp8", "load", "models", "runtime", "export", "interop"}
_TOP = _COMPOSED | {"save", "compose"}  # what the entry points and the test helpers may use
ALLOWED = {
    "errors": set(),
    "format": {"errors"},
    "reading": {"errors", "format"},
    "collective": {"errors", "format"},
    "fp8": {"errors", "format"},
    "models": {"errors"},
    "load": {"errors", "format", "reading", "collective", "fp8", "models"},
    "export": {"errors", "format", "collective", "fp8"},
    "runtime": {"errors", "format", "reading", "collective", "fp8", "load", "models"},
    "save": {"errors", "format", "reading", "collective", "fp8", "load", "models", "export"},
    "interop": _COMPOSED - {"interop"},
    "compose": _COMPOSED,
    "generation": _TOP,
    "serve": _TOP | {"generation"},
    "cli": _TOP | {"generation", "serve"},
    "testing": _TOP | {"generation"},
}
# The bottom every layer may use: error types, FSDP2's row arithmetic (which raises them), the
# quieting of other libraries' import-time notices
BOTTOM = {"errors", "shard_rows", "third_party"}
ALLOWED = {"errors": set(), "shard_rows": {"errors"}, "third_party": set()} | {
    layer: allowed | BOTTOM for layer, allowed in ALLOWED.items() if layer != "errors"
}
# third-party modules a layer must never import (prefix match)
FORBIDDEN_EXTERNAL = {
    "format": ("torch.nn", "torch.distributed", "torchao"),
    "reading": ("torch.nn", "torch.distributed", "torchao"),
    "shard_rows": ("torch",),
}
TOP_LEVEL = {
    "errors.py": "errors",
    "shard_rows.py": "shard_rows",
    "third_party.py": "third_party",  # quieting other libraries' import-time notices
    "__main__.py": "cli",
    "__init__.py": None,  # imports lazily
}


def layer_of(relative: Path) -> str | None:
    """``format/checkpoint.py`` -> ``format``; top-level modules by TOP_LEVEL."""
    if len(relative.parts) == 1:
        return TOP_LEVEL[relative.name]
    return relative.parts[0]


def _imports(tree: ast.AST):
    """(module imported, names, line) for every import, under ``if TYPE_CHECKING:`` too."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module, [a.name for a in node.names], node.lineno


def violations(relative: Path, source: str) -> list[str]:
    """Every rule ``source`` (the module at ``fsdp_fp8/relative``) breaks."""
    layer = layer_of(relative)
    if layer is None:
        return []
    own = "fsdp_fp8." + ".".join(relative.with_suffix("").parts)
    found = []
    for module, names, line in _imports(ast.parse(source)):
        where = f"fsdp_fp8/{relative.as_posix()}:{line}"
        for prefix in FORBIDDEN_EXTERNAL.get(layer, ()):
            if module == prefix or module.startswith(prefix + "."):
                found.append(f"{where}: layer `{layer}` imports `{module}`")
        if not (module == "fsdp_fp8" or module.startswith("fsdp_fp8.")):
            continue
        parts = module.split(".")
        targets = [parts[1]] if len(parts) > 1 else names  # `from fsdp_fp8 import x` names layers
        for target in targets:
            target_layer = TOP_LEVEL.get(f"{target}.py") or target
            if target_layer != layer and target_layer not in ALLOWED[layer]:
                found.append(f"{where}: layer `{layer}` imports `{module}` (layer `{target_layer}`)")
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        if private and module != own:
            found.append(f"{where}: imports private {', '.join(private)} from `{module}`")
    return found


def package_modules() -> list[Path]:
    return sorted(p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py"))


def test_every_module_is_in_a_known_layer():
    unknown = [
        str(p)
        for p in package_modules()
        if (len(p.parts) == 1 and p.name not in TOP_LEVEL) or (len(p.parts) > 1 and p.parts[0] not in ALLOWED)
    ]
    assert unknown == []


def test_layers_import_only_downwards():
    found = [v for p in package_modules() for v in violations(p, (PACKAGE / p).read_text())]
    assert found == [], "\n".join(found)


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("format/checkpoint.py", "import torch.distributed as dist"),
        ("format/checkpoint.py", "from torchao.quantization import x"),
        ("format/files.py", "def f():\n    from fsdp_fp8.load.plan import plan_load\n"),
        ("fp8/linear.py", "from fsdp_fp8 import load"),
        ("load/options.py", "from fsdp_fp8.cli.runner import main"),
        ("load/options.py", "from fsdp_fp8.load.reader import _load_local"),
        ("errors.py", "from fsdp_fp8.format import checkpoint"),
        ("collective/phase.py", "from fsdp_fp8.load.reader import load_checkpoint"),
        ("format/files.py", "from fsdp_fp8.collective import exchange"),
    ],
)
def test_a_forbidden_import_is_reported(module, source):
    assert len(violations(Path(module), source)) == 1


def test_a_back_edge_under_type_checking_is_reported_and_own_privates_are_allowed():
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fsdp_fp8.{} import {}\n"
    assert len(violations(Path("format/checkpoint.py"), guarded.format("load.plan", "LoadPlan"))) == 1
    assert violations(Path("cli/commands.py"), guarded.format("format.checkpoint", "Checkpoint")) == []
    assert violations(Path("load/reader.py"), "from fsdp_fp8.load.reader import _x") == []


MAX_FUNCTION_LINES = 70


def long_functions(source: str, where: str) -> list[str]:
    """Every function of ``source`` longer than ``MAX_FUNCTION_LINES`` (its docstring included)."""
    return [
        f"{where}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


def test_no_function_in_the_package_is_longer_than_70_lines():
    found = [f for p in package_modules() for f in long_functions((PACKAGE / p).read_text(), str(p))]
    assert found == [], "\n".join(found)


def test_a_long_function_is_reported():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}\n", "m.py") == [f"m.py:1 f: {MAX_FUNCTION_LINES + 1} lines"]
