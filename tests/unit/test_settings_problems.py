"""The settings every rank must share (``collective.settings``): the comparison that names each
setting that differs and which ranks hold which value, and the checkpoint identity it compares.
The 2-rank refusal itself: tests/distributed/test_settings_agreement.py."""

from __future__ import annotations

from fsdp_fp8.collective.settings import settings_problems
from fsdp_fp8.format.hub import checkpoint_identity


def test_matching_settings_are_no_problem():
    same = {"cfg_parallel": False, "attention_backend": "native", "step_policy": {"steps": [1, 2]}}
    assert settings_problems([dict(same), dict(same), dict(same)]) == []
    assert settings_problems([same]) == []


def test_each_differing_setting_is_one_line_naming_the_ranks_on_each_side():
    base = {"cfg_parallel": False, "attention_backend": "native", "timeout": 600.0, "ulysses": 1}
    ranks = [dict(base), dict(base, attention_backend="flex"), dict(base), dict(base, attention_backend="flex")]
    ranks[3]["cfg_parallel"] = True
    assert settings_problems(ranks) == [
        "cfg_parallel differs between ranks: ranks 0, 1, 2 False; rank 3 True",
        "attention_backend differs between ranks: ranks 0, 2 'native'; ranks 1, 3 'flex'",
    ]


def test_a_setting_one_rank_lacks_and_a_long_value_are_shown():
    long_policy = {"precision": ["W8A16"] * 40}
    problems = settings_problems([{"step_policy": "auto"}, {"step_policy": long_policy, "resident": "all"}])
    assert problems[0].startswith("step_policy differs between ranks: rank 0 'auto'; rank 1 {'precision': ")
    assert problems[0].endswith("...") and len(problems[0]) < 200
    assert problems[1] == "resident differs between ranks: rank 0 (absent); rank 1 'all'"


def test_a_number_and_its_float_are_told_apart_only_by_value():
    assert settings_problems([{"timeout": 600.0}, {"timeout": 600.0}]) == []
    assert settings_problems([{"timeout": 600.0}, {"timeout": 30.0}]) == [
        "timeout differs between ranks: rank 0 600.0; rank 1 30.0"
    ]


def test_the_checkpoint_identity_of_a_hub_snapshot_leaves_out_where_the_cache_is(tmp_path):
    identities = []
    for cache in ("node-a", "node-b"):
        snapshot = tmp_path / cache / "models--org--name" / "snapshots" / "abc123"
        snapshot.mkdir(parents=True)
        identities.append(checkpoint_identity(snapshot))
    assert identities == ["models--org--name/snapshots/abc123"] * 2
    plain = tmp_path / "ckpt"
    plain.mkdir()
    assert checkpoint_identity(plain) == str(plain)
    assert checkpoint_identity(tmp_path / "missing") == str(tmp_path / "missing")
