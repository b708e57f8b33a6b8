"""The package's layers and their direction, held by parsing every module's imports (nothing
is run). docs/design.md draws the same picture; change both together."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fsdp_fp8"

# layer -> the layers it may import (its own layer is always allowed)
ALLOWED = {
    "errors": set(),
    "format": {"errors"},
    "collective": {"errors", "format"},
    "fp8": {"errors", "format"},
    "models": {"errors"},
    "load": {"errors", "format", "collective", "fp8", "models"},
    "export": {"errors", "format", "collective", "fp8"},
    "runtime": {"errors", "format", "collective", "fp8", "load", "models"},
    "checkpoint": {"errors", "format", "collective", "fp8", "load", "models", "export"},
    "interop": {"errors", "format", "collective", "fp8", "load", "models", "runtime", "export"},
    "cli": {"errors", "format", "collective", "fp8", "load", "models", "runtime", "export", "interop", "checkpoint"},
    "testing": {
        "errors",
        "format",
        "collective",
        "fp8",
        "load",
        "models",
        "runtime",
        "export",
        "interop",
        "checkpoint",
    },
}
# third-party modules a layer must never import (prefix match)
FORBIDDEN_EXTERNAL = {
    "format": ("torch.nn", "torch.distributed", "torchao"),
}
# the foundation (errors, the quieting of other libraries' notices), the entry point, the lazy package
TOP_LEVEL = {"errors.py": "errors", "third_party.py": "errors", "__main__.py": "cli", "__init__.py": None}


def layer_of(relative: Path) -> str | None:
    """``format/checkpoint.py`` -> ``format``; top-level modules by TOP_LEVEL."""
    if len(relative.parts) == 1:
        return TOP_LEVEL[relative.name]
    return relative.parts[0]


def _imports(tree: ast.AST):
    """(module imported, names, line) for every import outside ``if TYPE_CHECKING:``."""

    def visit(node, guarded):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from visit(ast.Module(body=child.orelse, type_ignores=[]), guarded)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, [], child.lineno
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                yield child.module, [a.name for a in child.names], child.lineno
            yield from visit(child, guarded)

    yield from visit(tree, False)


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
        ("load/api.py", "from fsdp_fp8.cli.runner import main"),
        ("load/api.py", "from fsdp_fp8.load.loader import _load_local"),
        ("errors.py", "from fsdp_fp8.format import checkpoint"),
        ("collective/phase.py", "from fsdp_fp8.load.loader import load_checkpoint"),
        ("format/files.py", "from fsdp_fp8.collective import exchange"),
    ],
)
def test_a_forbidden_import_is_reported(module, source):
    assert len(violations(Path(module), source)) == 1


def test_type_checking_back_edges_and_own_privates_are_allowed():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fsdp_fp8.load.plan import LoadPlan\n"
    assert violations(Path("format/checkpoint.py"), source) == []
    assert violations(Path("load/loader.py"), "from fsdp_fp8.load.loader import _x") == []
