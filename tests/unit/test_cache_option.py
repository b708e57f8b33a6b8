"""``--cache`` / ``load_pipeline(cache=...)``: its words, its bounds, refused before anything loads."""

from __future__ import annotations

import pytest

from fsdp_fp8.format.cache_option import CacheChoice, cache_option_problems, parse_cache_option


def test_off_seacache_and_a_threshold_parse():
    assert parse_cache_option(None) is None and parse_cache_option("off") is None
    assert parse_cache_option("seacache") == CacheChoice("seacache")
    assert parse_cache_option("seacache:0.4") == CacheChoice("seacache", 0.4)
    assert parse_cache_option("seacache:0.4").describe() == "seacache:0.4"


@pytest.mark.parametrize(
    "value, needle",
    [
        ("teacache", "the method must be off or one of seacache"),
        ("seacache:x", "the threshold 'x' is not a number"),
        ("seacache:-1", "the threshold must be a finite number >= 0, got -1"),
        ("seacache:nan", "finite number >= 0"),
        (3, "must be text"),
    ],
)
def test_a_bad_value_is_named_with_the_option(value, needle):
    (problem,) = cache_option_problems(value)
    assert problem.startswith("--cache") and needle in problem
    with pytest.raises(ValueError, match="--cache"):
        parse_cache_option(value)


def test_the_launcher_refuses_a_bad_cache_before_the_load(capsys):
    from fsdp_fp8.cli.arguments import parse_run_args

    with pytest.raises(SystemExit) as exit_:
        parse_run_args(["--cache", "seacache:-1"])
    assert exit_.value.code == 2 and "--cache 'seacache:-1': the threshold must be" in capsys.readouterr().err
    assert parse_run_args(["--cache", "seacache:0.3"]).cache == "seacache:0.3"


def test_load_pipeline_takes_a_word_or_diffusers_own_config():
    pytest.importorskip("diffusers")
    from diffusers.hooks.sea_cache import SeaCacheConfig

    from fsdp_fp8.interop.step_cache import cache_config

    assert cache_config(None) is None and cache_config("off") is None
    assert cache_config("seacache") == SeaCacheConfig()  # diffusers' thresholds, not ours
    assert cache_config("seacache:0.5").threshold == 0.5
    given = SeaCacheConfig(max_consecutive_cached=3)
    assert cache_config(given) is given
    with pytest.raises(ValueError, match="cache 'fast'"):
        cache_config("fast")


def test_regional_compile_is_refused_before_the_load_naming_why(capsys):
    from fsdp_fp8.cli.arguments import parse_run_args

    with pytest.raises(SystemExit) as exit_:
        parse_run_args(["--compile", "regional"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--compile regional is not supported yet" in err
    assert "FSDPCosmos3VLTextMoTDecoderLayer" in err
    assert parse_run_args(["--compile", "off"]).compile == "off"


def test_the_computed_steps_range_is_the_rules_bounds():
    from fsdp_fp8.format.cache_option import computed_steps_range

    policy = ["W8A16"] * 3 + ["W8A8"] * 4 + ["W8A16"] * 3  # the demo's policy at 10 steps
    assert computed_steps_range(policy) == (5, 10)  # steps 0, 3, 6, 7, 9 (test_step_cache runs it)
    assert computed_steps_range(["W8A8"] * 35) == (13, 35)  # 0, 3, ..., 33 and the last
    assert computed_steps_range(["W8A8"] * 35, most_in_row=0) == (2, 35)  # no limit: first and last
    assert computed_steps_range(["W8A8"]) == (1, 1)


def test_inspect_prints_the_range_under_the_checkpoints_step_policy(demo_root, capsys):
    pytest.importorskip("diffusers")
    from fsdp_fp8.cli import commands

    assert commands.main(["inspect", str(demo_root), "--cache", "seacache", "--steps", "10"]) == 0
    out = capsys.readouterr().out
    assert "step cache:      seacache: 5..10 of 10 steps computed, 10..20 transformer passes" in out
