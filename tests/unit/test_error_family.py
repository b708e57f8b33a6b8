"""Every check in the package raises through the error family (``fsdp_fp8.errors``): a bare
``ValueError`` / ``TypeError`` is neither listed once with its fellows nor printed once by the
launcher. Held by parsing every module's ``raise`` statements (nothing is run)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_fp8"
BARE = {"ValueError", "TypeError"}


def bare_raises(source: str, where: str) -> list[str]:
    """Every ``raise ValueError(...)`` / ``raise TypeError`` in ``source``, as ``where:line``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Raise) or node.exc is None:
            continue
        target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
        if isinstance(target, ast.Name) and target.id in BARE:
            found.append((node.lineno, f"{where}:{node.lineno} raises a bare {target.id}"))
    return [text for _, text in sorted(found)]


def test_no_check_in_the_package_raises_a_bare_value_or_type_error():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += bare_raises(path.read_text(), path.relative_to(PACKAGE).as_posix())
    assert found == [], "\n".join(found)


def test_a_bare_raise_is_reported_and_the_familys_is_not():
    source = "def f(x):\n    if x:\n        raise ValueError('no')\n    raise TypeError\n"
    assert bare_raises(source, "m.py") == ["m.py:3 raises a bare ValueError", "m.py:4 raises a bare TypeError"]
    assert bare_raises("raise ArgumentError(['no'])\nraise RuntimeError('x')\n", "m.py") == []


def test_the_family_is_still_the_builtin_kind_callers_catch():
    from fsdp_fp8.errors import ArgumentError, ArgumentTypeError, LayoutError, ProblemsError

    assert issubclass(ArgumentError, ValueError) and issubclass(ArgumentTypeError, TypeError)
    assert issubclass(LayoutError, ArgumentError) and issubclass(ArgumentTypeError, ProblemsError)
    assert ArgumentError("one problem").problems == ["one problem"]  # a string is one problem, not its letters
