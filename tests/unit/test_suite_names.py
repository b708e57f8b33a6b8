"""The suite's own shape: the two tiers share one import path (tests/conftest.py), so two test
modules of one name collide (pytest's "import file mismatch", and the ranks harness then finds
one module's functions in the other: a merge once made tests/unit/test_actions.py beside
tests/distributed/test_actions.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent


def test_no_two_test_modules_share_a_name():
    names = Counter(path.name for path in TESTS.rglob("*.py") if "__pycache__" not in path.parts)
    assert sorted(name for name, count in names.items() if count > 1 and name != "__init__.py") == []
