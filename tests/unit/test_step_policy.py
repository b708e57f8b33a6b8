"""The diffusion step policy (docs/step-policy.md): parsing and the window rule.

Expected windows are written out by hand from the published rule (docs/step-policy.md), not computed by the
code under test: "A" is W8A16 ("a16"), "." is W8A8 ("native").
"""

from __future__ import annotations

import copy
import logging

import pytest

from fsdp_fp8.errors import CheckpointError
from fsdp_fp8.format.step_policy import (
    PUBLISHED_POLICY,
    StepPolicy,
    describe_trace,
    parse_step_policy,
    resolve_step_policy,
)


def _policy(first: int, last: int, overlap: str = "a16", reasoner: str = "a16") -> dict:
    raw = copy.deepcopy(PUBLISHED_POLICY)
    raw["first_steps"]["count"] = first
    raw["last_steps"]["count"] = last
    raw["overlap"] = overlap
    raw["reasoner"] = reasoner
    return raw


# (first, last, overlap, n, expected pattern)
WINDOWS = [
    # the published policy: first 3 / last 3, overlap a16
    (3, 3, "a16", 1, "."),  # one-step requests stay native
    (3, 3, "a16", 2, "AA"),
    (3, 3, "a16", 5, "AAAAA"),
    (3, 3, "a16", 6, "AAAAAA"),
    (3, 3, "a16", 7, "AAA.AAA"),
    (3, 3, "a16", 50, "AAA" + "." * 44 + "AAA"),
    # overlap native: steps in both windows fall back to native
    (3, 3, "native", 1, "."),
    (3, 3, "native", 2, ".."),  # both steps are in both windows
    (3, 3, "native", 5, "AA.AA"),  # step 2: 2 < 3 and 2 >= 5 - 3
    (3, 3, "native", 6, "AAAAAA"),  # windows just touch, no overlap
    (3, 3, "native", 7, "AAA.AAA"),
    (3, 3, "native", 50, "AAA" + "." * 44 + "AAA"),
    # other counts
    (0, 0, "a16", 1, "."),
    (0, 0, "a16", 5, "....."),
    (0, 0, "native", 6, "......"),
    (1, 0, "a16", 1, "."),
    (1, 0, "a16", 5, "A...."),
    (0, 1, "a16", 5, "....A"),
    (0, 1, "native", 2, ".A"),
    (2, 1, "a16", 7, "AA....A"),
    (2, 1, "native", 3, "AAA"),  # step 2 only in the last window
    (2, 1, "native", 2, "A."),  # step 1 in both windows
    (1, 4, "native", 5, "AAAAA"),  # windows just touch
    (1, 4, "native", 4, ".AAA"),  # step 0 in both windows
    (10, 10, "a16", 7, "AAAAAAA"),
    (10, 10, "native", 7, "......."),
    (10, 0, "native", 7, "AAAAAAA"),
    (5, 5, "native", 50, "AAAAA" + "." * 40 + "AAAAA"),
]


@pytest.mark.parametrize("first,last,overlap,n,expected", WINDOWS)
def test_window(first, last, overlap, n, expected):
    policy = parse_step_policy(_policy(first, last, overlap))
    assert len(expected) == n  # guards the table itself
    want = ["a16" if c == "A" else "native" for c in expected]
    assert [policy.precision(i, n) for i in range(n)] == want


def test_published_policy_parses():
    policy = parse_step_policy(PUBLISHED_POLICY)
    assert policy == StepPolicy(first_count=3, last_count=3, overlap="a16", reasoner="a16")
    assert policy.reasoner_precision == "a16"
    # Parsing must not rely on or alter the caller's dict.
    assert PUBLISHED_POLICY["first_steps"] == {"count": 3, "mode": "a16"}


def test_published_policy_matches_format_md():
    # The published example (docs/step-policy.md), typed in again: PUBLISHED_POLICY must not drift from it.
    assert PUBLISHED_POLICY == {
        "schema_version": 1, "type": "first_last_n", "index_space": "denoising_loop_iteration",
        "scope": ["transformer"], "default_mode": "native",
        "first_steps": {"count": 3, "mode": "a16"}, "last_steps": {"count": 3, "mode": "a16"},
        "overlap": "a16", "reasoner": "a16",
    }  # fmt: skip


@pytest.mark.parametrize("reasoner", ["a16", "native"])
def test_reasoner_is_stated_not_derived(reasoner):
    policy = parse_step_policy(_policy(3, 3, reasoner=reasoner))
    assert policy.reasoner_precision == reasoner


def test_policy_is_frozen():
    policy = parse_step_policy(PUBLISHED_POLICY)
    with pytest.raises(AttributeError):
        policy.first_count = 0  # type: ignore[misc]


@pytest.mark.parametrize("step,n", [(-1, 5), (5, 5), (6, 5), (0, 0), (0, -1), (True, 5), (0, True), (1.0, 5), (0, 5.0)])
def test_precision_rejects_bad_step(step, n):
    with pytest.raises(ValueError):
        parse_step_policy(PUBLISHED_POLICY).precision(step, n)


def _refusal(raw) -> list[str]:
    with pytest.raises(CheckpointError) as info:
        parse_step_policy(raw, source="ckpt/config.json")
    assert info.value.context == "ckpt/config.json"
    assert "ckpt/config.json" in str(info.value)
    return info.value.problems


def _assert_names(problems: list[str], field: str) -> None:
    assert any(f"`{field}`" in p for p in problems), problems


TOP = sorted(PUBLISHED_POLICY)


@pytest.mark.parametrize("field", TOP)
def test_missing_top_field(field):
    raw = copy.deepcopy(PUBLISHED_POLICY)
    del raw[field]
    problems = _refusal(raw)
    assert len(problems) == 1, problems
    _assert_names(problems, f"diffusion_step_policy.{field}")
    assert "missing" in problems[0]


@pytest.mark.parametrize("window", ["first_steps", "last_steps"])
@pytest.mark.parametrize("field", ["count", "mode"])
def test_missing_window_field(window, field):
    raw = copy.deepcopy(PUBLISHED_POLICY)
    del raw[window][field]
    problems = _refusal(raw)
    assert len(problems) == 1, problems
    _assert_names(problems, f"diffusion_step_policy.{window}.{field}")


def test_empty_policy_lists_every_missing_field():
    problems = _refusal({})
    assert len(problems) == len(TOP)
    for field in TOP:
        _assert_names(problems, f"diffusion_step_policy.{field}")


WRONG_VALUES = [
    ("schema_version", 2),
    ("schema_version", 0),
    ("schema_version", True),  # bool == 1 in Python, but it is not the integer 1
    ("schema_version", "1"),
    ("schema_version", 1.0),
    ("schema_version", None),
    ("type", "first_n"),
    ("type", "FIRST_LAST_N"),
    ("type", None),
    ("index_space", "timestep"),
    ("index_space", "scheduler_step"),
    ("default_mode", "a16"),
    ("default_mode", "w8a8"),
    ("default_mode", None),
    ("overlap", "w8a16"),
    ("overlap", "A16"),
    ("overlap", None),
    ("overlap", 1),
    ("reasoner", "bf16"),
    ("reasoner", ""),
    ("reasoner", ["a16"]),
    ("scope", "transformer"),
    ("scope", []),
    ("scope", ["transformer", "text_encoder"]),
    ("scope", ["vae"]),
    ("scope", [None]),
    ("scope", None),
    ("first_steps", 3),
    ("first_steps", None),
    ("last_steps", [3, "a16"]),
]


@pytest.mark.parametrize("field,value", WRONG_VALUES, ids=[f"{f}={v!r}" for f, v in WRONG_VALUES])
def test_wrong_top_value(field, value):
    raw = copy.deepcopy(PUBLISHED_POLICY)
    raw[field] = value
    problems = _refusal(raw)
    prefix = f"`diffusion_step_policy.{field}"
    assert problems and all(p.startswith(prefix) for p in problems), problems


@pytest.mark.parametrize("window", ["first_steps", "last_steps"])
@pytest.mark.parametrize(
    "field,value",
    [
        ("count", -1),
        ("count", -100),
        ("count", 1.5),
        ("count", 3.0),
        ("count", "3"),
        ("count", True),
        ("count", False),
        ("count", None),
        ("mode", "native"),  # a window that runs native is not a first_last_n window
        ("mode", "w8a16"),
        ("mode", None),
    ],
)
def test_wrong_window_value(window, field, value):
    raw = copy.deepcopy(PUBLISHED_POLICY)
    raw[window][field] = value
    problems = _refusal(raw)
    assert len(problems) == 1, problems
    _assert_names(problems, f"diffusion_step_policy.{window}.{field}")


def test_unknown_top_field():
    raw = copy.deepcopy(PUBLISHED_POLICY)
    raw["guidance_scale"] = 5
    problems = _refusal(raw)
    assert len(problems) == 1
    _assert_names(problems, "diffusion_step_policy.guidance_scale")


@pytest.mark.parametrize("window", ["first_steps", "last_steps"])
def test_unknown_window_field(window):
    raw = copy.deepcopy(PUBLISHED_POLICY)
    raw[window]["unit"] = "steps"
    problems = _refusal(raw)
    assert len(problems) == 1
    _assert_names(problems, f"diffusion_step_policy.{window}.unit")


def test_schema_2_is_refused_even_if_otherwise_valid():
    raw = copy.deepcopy(PUBLISHED_POLICY)
    raw["schema_version"] = 2
    problems = _refusal(raw)
    assert problems == ["`diffusion_step_policy.schema_version` must be 1, got 2"]


def test_every_problem_is_reported_at_once():
    raw = copy.deepcopy(PUBLISHED_POLICY)
    raw["schema_version"] = 2
    raw["first_steps"]["count"] = -1
    raw["last_steps"]["mode"] = "native"
    raw["reasoner"] = "fp8"
    del raw["overlap"]
    raw["extra"] = 0
    problems = _refusal(raw)
    assert len(problems) == 6, problems
    for field in ["schema_version", "first_steps.count", "last_steps.mode", "reasoner",
                  "overlap", "extra"]:  # fmt: skip
        _assert_names(problems, f"diffusion_step_policy.{field}")


@pytest.mark.parametrize("raw", [None, [], "first_last_n", 1])
def test_non_object_policy(raw):
    problems = _refusal(raw)
    _assert_names(problems, "diffusion_step_policy")


# --- resolve_step_policy -------------------------------------------------------------------


def test_auto_uses_the_checkpoint_policy():
    assert resolve_step_policy(PUBLISHED_POLICY) == parse_step_policy(PUBLISHED_POLICY)
    assert resolve_step_policy(PUBLISHED_POLICY, "auto") == parse_step_policy(PUBLISHED_POLICY)


def test_auto_without_checkpoint_policy_is_none():
    # The library adds no policy of its own: a checkpoint without one runs fully W8A8.
    assert resolve_step_policy(None) is None
    assert resolve_step_policy(None, "off") is None


def test_off_disables_and_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="fsdp_fp8.format.step_policy"):
        assert resolve_step_policy(PUBLISHED_POLICY, "off") is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "checkpoint's diffusion step policy" in warnings[0].getMessage()
    assert "disabled" in warnings[0].getMessage()


def test_dict_override_is_parsed_and_logged(caplog):
    override = _policy(1, 2, overlap="native", reasoner="native")
    with caplog.at_level(logging.INFO, logger="fsdp_fp8.format.step_policy"):
        policy = resolve_step_policy(PUBLISHED_POLICY, override)
    assert policy == StepPolicy(first_count=1, last_count=2, overlap="native", reasoner="native")
    assert any("override" in r.getMessage() for r in caplog.records)
    # An override also applies to a checkpoint that publishes no policy.
    assert resolve_step_policy(None, override) == policy


def test_bad_override_dict_is_refused():
    override = _policy(1, 2)
    override["schema_version"] = 2
    with pytest.raises(CheckpointError, match="schema_version"):
        resolve_step_policy(PUBLISHED_POLICY, override)


@pytest.mark.parametrize("override", ["on", "", None, 3, "AUTO"])
def test_unknown_override_value(override):
    with pytest.raises(ValueError, match="override"):
        resolve_step_policy(PUBLISHED_POLICY, override)


def test_malformed_checkpoint_policy_is_refused_under_every_override():
    raw = copy.deepcopy(PUBLISHED_POLICY)
    raw["type"] = "cosine"
    for override in ["auto", "off", PUBLISHED_POLICY]:
        with pytest.raises(CheckpointError, match="diffusion_step_policy.type"):
            resolve_step_policy(raw, override)


# --- describe_trace -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "precisions,expected",
    [
        ([], ""),
        (["native"], "W8A8 x1"),
        (["a16"] * 3 + ["native"] * 44 + ["a16"] * 3, "W8A16 x3 / W8A8 x44 / W8A16 x3"),
        (["a16", "native", "a16", "a16"], "W8A16 x1 / W8A8 x1 / W8A16 x2"),
    ],
)
def test_describe_trace(precisions, expected):
    assert describe_trace(precisions) == expected


def test_describe_trace_of_the_published_policy():
    policy = parse_step_policy(PUBLISHED_POLICY)
    trace = [policy.precision(i, 50) for i in range(50)]
    assert describe_trace(trace) == "W8A16 x3 / W8A8 x44 / W8A16 x3"


def test_describe_trace_rejects_unknown():
    with pytest.raises(ValueError, match="bf16"):
        describe_trace(["a16", "bf16"])


@pytest.mark.parametrize(
    "first, last, overlap, reasoner, words",
    [
        (3, 3, "a16", "a16", "W8A16 steps 0-2 and the last 3 (W8A8 between), reasoner W8A16"),
        (3, 3, "native", "native", "W8A16 steps 0-2 and the last 3 (W8A8 between), W8A8 where the two overlap, "
         "reasoner W8A8"),
        (1, 0, "a16", "a16", "W8A16 step 0 (W8A8 after), reasoner W8A16"),
        (0, 1, "native", "a16", "W8A16 the last step (W8A8 before), reasoner W8A16"),
        (0, 0, "a16", "native", "W8A8 every step, reasoner W8A8"),
    ],
)  # fmt: skip
def test_a_policy_is_described_in_a_users_words(first, last, overlap, reasoner, words):
    """What ``inspect`` and the launcher's log say: the windows by step, not the schema's fields."""
    from fsdp_fp8.format.step_policy import describe_policy

    assert describe_policy(parse_step_policy(_policy(first, last, overlap, reasoner))) == words
