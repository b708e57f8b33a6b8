"""The launcher's options, in process: every value is checked before anything is loaded, all
problems in one usage error; options the model kind would ignore are named in a warning."""

from __future__ import annotations

import pytest

from fsdp_fp8.cli.options import unused_options, value_problems
from fsdp_fp8.cli.runner import parse_args


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_bad_values_are_one_usage_error_listing_all_of_them(tmp_path, capsys):
    err = _usage_error(
        [
            "--latent-tokens",
            "-4",
            "--new-tokens",
            "0",
            "--steps",
            "0",
            "--timeout",
            "-1",
            "--output",
            str(tmp_path / "nowhere" / "x.png"),
            "--prompts",
            str(tmp_path / "none.txt"),
            "--prompt-ids",
            "3,-1",
        ],
        capsys,
    )
    line = err.strip().splitlines()[-1]
    expected = [
        f"--output {tmp_path / 'nowhere' / 'x.png'}: directory {tmp_path / 'nowhere'} does not exist",
        f"--prompts {tmp_path / 'none.txt'}: no such file",
        "--prompt-ids must list token ids >= 0, got [3, -1]",
        "--latent-tokens must be >= 1, got -4",
        "--new-tokens must be >= 1, got 0",
        "--steps must be >= 1, got 0",
        "--timeout must be > 0, got -1.0",
    ]
    problems = line.removeprefix("launch/infer.py: error: ").split("; ")
    assert sorted(problems) == sorted(expected), line


@pytest.mark.parametrize(
    "world, replicas, problem",
    [
        ("4", "3", "--replicas 3 does not divide the world size 4: HSDP needs every replica group to have the same"),
        ("4", "0", "--replicas must be >= 1, got 0"),
        (None, "2", "--replicas 2 does not divide the world size 1"),  # one process: nothing to replicate
    ],
)
def test_replicas_that_cannot_cut_the_world_are_a_usage_error(world, replicas, problem, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if world is not None:
        monkeypatch.setenv("WORLD_SIZE", world)
    assert problem in _usage_error(["--replicas", replicas], capsys)


def test_replicas_that_divide_the_world_pass(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert parse_args(["--replicas", "2"]).replicas == 2
    assert parse_args([]).replicas == 1


def test_a_report_into_a_missing_directory_is_made_before_the_run(tmp_path):
    report = tmp_path / "new" / "dir" / "r.json"
    parse_args(["--report", str(report)])
    assert report.parent.is_dir()


def test_report_path_checks(tmp_path):
    class Args:
        report = str(tmp_path)

    assert value_problems(Args()) == [f"--report {tmp_path} is a directory; name a file"]
    Args.report = str(tmp_path / "r.json")
    assert value_problems(Args()) == []
    (tmp_path / "ro").mkdir(mode=0o555)
    Args.report = str(tmp_path / "ro" / "r.json")
    import os

    if os.access(tmp_path / "ro", os.W_OK):  # root ignores the mode
        pytest.skip("running as root: every directory is writable")
    assert value_problems(Args()) == [f"--report {Args.report}: directory {tmp_path / 'ro'} is not writable"]


def test_good_values_pass(tmp_path):
    args = parse_args(["--steps", "2", "--latent-tokens", "8", "--report", str(tmp_path / "r.json")])
    assert (args.steps, args.latent_tokens) == (2, 8)


@pytest.mark.parametrize(
    "kind, given, unused",
    [
        ("mot", {"steps", "latent_tokens", "new_tokens", "prompt_ids", "report"}, ["--new-tokens", "--prompt-ids"]),
        (
            "causal_lm",
            {"steps", "guidance", "new_tokens", "prompt", "step_policy"},
            ["--guidance", "--step-policy", "--steps"],
        ),
        ("diffusers", {"seed", "steps", "timeout"}, ["--steps"]),
        ("pipeline", {"frames", "latent_tokens", "steps"}, ["--latent-tokens"]),
        ("cosmos3", {"negative_prompt", "frames"}, ["--frames"]),
    ],
)
def test_options_a_kind_ignores_are_named(kind, given, unused):
    assert unused_options(given, kind) == unused


# --- whole runs, in process (one process, no group) -------------------------------------


@pytest.fixture(scope="module")
def bf16_mot(tmp_path_factory):
    """A plain high-precision reference-MoT checkpoint: no FP8 linear at all."""
    from fsdp_fp8.export.modelopt import export_bf16
    from fsdp_fp8.models import PRESETS, build_model, init_weights

    model = init_weights(build_model(PRESETS["tiny"], device="cpu"), seed=0)
    return export_bf16(model, tmp_path_factory.mktemp("bf16") / "ckpt", config=model.config.to_config_dict())


def _run(argv, tmp_path, caplog):
    import json

    from fsdp_fp8.cli.runner import main

    report = tmp_path / "report.json"
    with caplog.at_level("WARNING", logger="fsdp_fp8"):
        assert main([*argv, "--report", str(report)]) == 0
    return json.loads(report.read_text())


def test_no_fp8_linear_is_a_warning_and_no_precision_trace(bf16_mot, tmp_path, caplog, capsys):
    result = _run(["--checkpoint", str(bf16_mot), "--steps", "2", "--latent-tokens", "4"], tmp_path, caplog)
    assert result["fp8_linears"] == 0 and result["precision_trace"] is None
    assert "has no FP8 linear: every linear runs in high precision" in caplog.text
    out = capsys.readouterr().out
    assert "precision       high precision (no FP8 linear)" in out and "W8A8" not in out


def test_options_the_model_ignores_are_named_and_the_digest_names_its_platform(bf16_mot, tmp_path, caplog, capsys):
    import torch

    from fsdp_fp8.cli.platform import cpu_model

    result = _run(
        [
            "--checkpoint",
            str(bf16_mot),
            "--steps",
            "2",
            "--latent-tokens",
            "4",
            "--new-tokens",
            "3",
            "--prompt-ids",
            "1,2",
        ],
        tmp_path,
        caplog,
    )
    assert "--new-tokens, --prompt-ids do not apply to ReferenceMoTTransformer and are ignored" in caplog.text
    assert result["torch"] == torch.__version__ and result["device_name"] == cpu_model()
    out = capsys.readouterr().out
    digest = next(line for line in out.splitlines() if line.startswith("latent "))
    platform = out.splitlines()[out.splitlines().index(digest) + 1]
    assert platform == (
        f"computed with   torch {torch.__version__} on cpu, {cpu_model()}; digests compare only "
        "with runs on the same torch build and device model"
    )
