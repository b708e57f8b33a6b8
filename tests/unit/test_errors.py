"""The error family (fsdp_fp8.errors): one formatter, problems listed once, every error pickles."""

from __future__ import annotations

import pickle

import pytest

from fsdp_fp8 import errors


def test_problems_are_sorted_deduplicated_and_counted():
    exc = errors.CheckpointError(["`b` is bad", "`a` is bad", "`b` is bad"], "checkpoint x")
    assert exc.problems == ["`a` is bad", "`b` is bad"]
    assert str(exc) == "checkpoint x: 2 problems:\n  - `a` is bad\n  - `b` is bad"
    assert str(errors.ExportError(["only"])) == "cannot export: 1 problem:\n  - only"


@pytest.mark.parametrize(
    "cls, base",
    [
        (errors.CheckpointError, ValueError),
        (errors.ExportError, ValueError),
        (errors.QuantizeError, ValueError),
        (errors.LoadFailedError, RuntimeError),
    ],
)
def test_every_problems_error_survives_pickling_with_its_parts(cls, base):
    exc = cls(["rank 1: x", "rank 0: y"], "ctx")
    back = pickle.loads(pickle.dumps(exc))  # results and errors cross process pipes between ranks
    assert type(back) is cls and isinstance(back, base) and isinstance(back, errors.ProblemsError)
    assert (back.problems, back.context, str(back)) == (exc.problems, exc.context, str(exc))


def test_raise_if_problems_raises_once_with_everything_or_not_at_all():
    errors.raise_if_problems([], "ctx", errors.ExportError)
    with pytest.raises(errors.QuantizeError) as info:
        errors.raise_if_problems(["b", "a"], error=errors.QuantizeError)
    assert info.value.problems == ["a", "b"] and info.value.context == "cannot quantize the model"
