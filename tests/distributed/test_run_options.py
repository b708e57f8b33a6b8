"""The launcher's options, in process: every value is checked before anything is loaded, all
problems in one usage error; options the model kind would ignore are named in a warning."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fsdp_fp8.cli.arguments import file_problems
from fsdp_fp8.cli.arguments import parse_run_args as parse_args
from fsdp_fp8.generation.checks import unused_options


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

    assert file_problems(Args()) == [f"--report {tmp_path} is a directory; name a file"]
    Args.report = str(tmp_path / "r.json")
    assert file_problems(Args()) == []
    (tmp_path / "ro").mkdir(mode=0o555)
    Args.report = str(tmp_path / "ro" / "r.json")
    import os

    if os.access(tmp_path / "ro", os.W_OK):  # root ignores the mode
        pytest.skip("running as root: every directory is writable")
    assert file_problems(Args()) == [f"--report {Args.report}: directory {tmp_path / 'ro'} is not writable"]


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


# --- outputs, bounds and the prompts file: refused before anything loads -----------------


def _refusal_without_torch(
    argv: list[str], env: dict | None = None, cwd=None, many: bool = False
) -> tuple[int | list[int], str, list[str]]:
    """``python -m fsdp_fp8 run ARGV`` in a fresh interpreter: (exit code, stderr, the heavy
    modules imported by then). A refusal that comes before torch is imported comes before any
    checkpoint is opened, let alone a weight read. ``many``: ARGV is one JSON list of argument
    lists, run one after the other in that interpreter (their exit codes, in order)."""
    import json
    import os
    import subprocess
    import sys

    run = "def run(argv):\n    try:\n        main(['run', *argv])\n    except SystemExit as e:\n        return e.code\n"
    code = (
        "import json, sys\n"
        "from fsdp_fp8.cli.commands import main\n"
        + run
        + ("code = [run(a) for a in json.loads(sys.argv[1])]\n" if many else "code = run(sys.argv[1:])\n")
        + "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'safetensors', 'diffusers'))\n"
        "print(json.dumps([code, heavy[:3]]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )
    exit_code, heavy = json.loads(proc.stdout.strip().splitlines()[-1])
    return exit_code, proc.stderr, heavy


def test_outputs_that_cannot_be_written_are_refused_before_torch_loads(tmp_path):
    from pathlib import Path

    fixture = Path(__file__).parents[1] / "fixtures" / "modelopt-0.47-llama-sharded"
    existing = tmp_path / "done.png"
    existing.write_bytes(b"a result from yesterday")
    (tmp_path / "report.json").write_text("{}")
    (tmp_path / "shot-001.png").write_bytes(b"prompt 1's result")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\nthree\n")
    cases = {
        "dir": (["--output", str(tmp_path)], f"--output {tmp_path}: write .png"),
        "dir.png": (["--output", str(tmp_path / "sub.png")], f"--output {tmp_path / 'sub.png'} is a directory"),
        "existing": (["--output", str(existing)], f"--output {existing} already exists; pass --overwrite"),
        "report": (["--report", str(tmp_path / "report.json")], "--report " + str(tmp_path / "report.json")),
        "per-prompt": (
            ["--prompts", str(prompts), "--output", str(tmp_path / "shot.png")],
            f"--output {tmp_path / 'shot-001.png'} already exists",
        ),
    }
    (tmp_path / "sub.png").mkdir()
    for name, (argv, message) in cases.items():
        code, err, heavy = _refusal_without_torch(["--checkpoint", str(fixture), *argv])
        assert code == 2 and message in err, (name, err)
        assert err.count("error:") == 1 and heavy == [], (name, err, heavy)
    assert existing.read_bytes() == b"a result from yesterday"


def test_overwrite_lets_existing_outputs_through(tmp_path):
    existing = tmp_path / "done.png"
    existing.write_bytes(b"old")
    (tmp_path / "r.json").write_text("{}")
    args = parse_args(["--output", str(existing), "--report", str(tmp_path / "r.json"), "--overwrite"])
    assert args.overwrite and args.output == str(existing)
    with pytest.raises(SystemExit):
        parse_args(["--output", str(existing)])


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["--steps", "1000000000000000"], "--steps must be <= 10,000, got 1,000,000,000,000,000"),
        (["--frames", "100000"], "--frames must be <= 1,024, got 100,000"),
        (["--height", "20000"], "--height must be <= 16,384, got 20,000"),
        (["--width", "99999"], "--width must be <= 16,384, got 99,999"),
        (["--fps", "1e9"], "--fps must be <= 1000, got 1e+09"),
        (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1, got 0"),
        (["--timeout", "1e300"], "--timeout must be <= 86,400 seconds (a day), got 1e+300"),
        (["--timeout", "inf"], "--timeout must be <= 86,400 seconds (a day), got inf"),
        (["--timeout", "nan"], "--timeout must be > 0, got nan"),
        (["--prompt", "x" * 16_385], "--prompt is 16,385 bytes; a prompt is at most 16,384 bytes (UTF-8)"),
        (["--negative-prompt", "\u00e9" * 8_193], "--negative-prompt is 16,386 bytes; a prompt is at most 16,384"),
    ],
)
def test_values_out_of_their_documented_bounds_are_usage_errors(argv, problem, capsys):
    assert problem in _usage_error(argv, capsys)


def test_a_prompts_file_that_is_not_utf8_names_the_file_the_line_and_the_offset(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("a red fox\nun caf\u00e9 \n".encode() + b"a \xff lighthouse\n")
    err = _usage_error(["--prompts", str(prompts)], capsys)
    offset = prompts.read_bytes().index(b"\xff")
    assert f"--prompts {prompts}: not UTF-8 text: line 3, byte offset {offset} (byte 0xff)" in err


def test_a_usage_error_is_printed_by_rank_0_only(monkeypatch, capsys):
    import os

    from fsdp_fp8.cli import interrupts

    # Another rank waits before it exits: torchrun ends every rank once one exits, and a rank 1
    # exiting first could have rank 0 killed before it printed the error (seen in CI).
    waits = []
    monkeypatch.setattr(interrupts, "wait_for_rank_0", lambda: waits.append(os.environ["RANK"]))
    monkeypatch.setenv("RANK", "1")
    assert _usage_error(["--steps", "0"], capsys) == ""  # exit 2, silently
    monkeypatch.setenv("RANK", "0")
    err = _usage_error(["--steps", "0"], capsys)
    assert err.count("usage:") == 1 and "--steps must be >= 1, got 0" in err
    assert waits == ["1"]  # rank 1 waited; rank 0 printed and did not


def test_only_an_error_of_a_ranks_own_files_is_printed_by_it_after_the_wait(tmp_path, monkeypatch, capsys):
    """A rank other than 0 still running after its wait (rank 0 has not ended the job) prints an
    error its node's files caused, naming itself; one every rank meets (a value) stays rank 0's."""
    from fsdp_fp8.cli import interrupts

    monkeypatch.setattr(interrupts, "wait_for_rank_0", lambda: True)  # waited the whole grace
    monkeypatch.setenv("RANK", "1")
    assert _usage_error(["--steps", "0"], capsys) == ""
    err = _usage_error(["--prompts", str(tmp_path / "none.txt")], capsys)
    assert (
        err
        == f"launch/infer.py: error (rank 1; rank 0 did not meet it): --prompts {tmp_path / 'none.txt'}: no such file\n"
    )


def test_a_rank_waits_for_rank_0_under_torchrun_only(monkeypatch):
    from fsdp_fp8.cli import interrupts

    slept = []
    monkeypatch.setattr(interrupts.time, "sleep", slept.append)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    interrupts.wait_for_rank_0()  # no torchrun: nobody would kill rank 0, nothing to wait for
    assert slept == []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    interrupts.wait_for_rank_0()
    assert slept == [interrupts.ERROR_GRACE_S]


def test_a_signal_taken_in_a_native_wait_s_block_goes_the_handler_s_way():
    """``ended_in_native_wait`` ends the rank only for a signal its handler has not taken (a main
    thread stuck in native code: tests/distributed/test_launcher.py's rendezvous); one taken is the
    handler's ``Interrupted``, and the process goes on (else this test's process would end)."""
    import os
    import signal
    import time

    from fsdp_fp8.cli import interrupts

    handlers = {s: signal.getsignal(s) for s in interrupts.SIGNALS}
    try:
        interrupts.install()
        with pytest.raises(interrupts.Interrupted, match="stopped by SIGTERM"):
            with interrupts.ended_in_native_wait():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(3 * interrupts.NATIVE_GRACE_S)  # Python: the handler raises at once
        # The block joined its watcher on the way out: had it ended the process, nothing would run here.
        assert signal.set_wakeup_fd(-1) == -1  # and it put back the wakeup fd it found
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def test_the_choices_parsed_without_torch_are_the_librarys():
    from fsdp_fp8.generation.values import QUANTIZE_METHODS, RESIDENT_POLICIES
    from fsdp_fp8.runtime.ptq import METHODS
    from fsdp_fp8.runtime.residency import POLICIES

    assert (RESIDENT_POLICIES, QUANTIZE_METHODS) == (POLICIES, METHODS)


# --- the report: typed, worded for a reader ----------------------------------------------


def _causal_lm_report(kv_scales_unused: int, bytes_read: int):
    from fsdp_fp8.cli.reports import CausalLMReport, RankRow

    row = RankRow(
        rank=0,
        bytes_held=bytes_read,
        bytes_read=bytes_read,
        load_seconds=0.2,
        read_seconds=0.1,
        read_gb_per_s=bytes_read / 0.1 / 1e9,
        peak_rss_bytes=None,
        peak_device_bytes=None,
    )
    common = dict(checkpoint="ckpt", world_size=1, mesh=[1, 1], device="cpu", fp8_linears=14, load_seconds=1.5)
    return CausalLMReport(
        **common,
        ranks=[row],
        architecture="LlamaForCausalLM",
        kv_scales_unused=kv_scales_unused,
        run_seconds=0.5,
        prompt_ids=[1, 2],
        prompt_source="--prompt-ids",
        generated_ids=[5],
        logits_sha256="0" * 64,
    )


def test_the_report_leaves_out_zero_counts_and_says_what_its_times_are():
    quiet, noisy = _causal_lm_report(0, 4096).text(), _causal_lm_report(2, 8 << 20).text()
    assert "KV-cache" not in quiet and "2 KV-cache scales unused" in noisy
    assert "1 token generated" in quiet
    assert "load            1.50 s for the job" in quiet and "load s: the rank's own load_model" in quiet

    def rate(text: str) -> str:  # the GB/s cell of rank 0's row: rank, held (2 words), read (2), load s, read s
        return next(line for line in text.splitlines() if line.startswith("   0  ")).split()[7]

    assert (rate(quiet), rate(noisy)) == ("-", "0.08")  # from 4 KiB read a rate says nothing; 8 MiB in 0.1 s


def test_each_kind_of_report_is_its_own_type_and_its_json_keeps_the_fields(bf16_mot, tmp_path, caplog, capsys):
    from fsdp_fp8.cli import reports

    result = _run(["--checkpoint", str(bf16_mot), "--steps", "2", "--latent-tokens", "4"], tmp_path, caplog)
    fields = {f.name for f in reports.MoTReport.__dataclass_fields__.values()}
    assert set(result) == fields and set(result["ranks"][0]) == set(reports.RankRow.__dataclass_fields__)
    out = capsys.readouterr().out
    assert "resident        " in out and "of 0 blocks" not in out and "sampling        2 steps" in out


# --- careless input: each refused before torch loads, one error line naming the option -------


def _careless(tmp_path: Path, case: str) -> tuple[list[str], str]:
    """(argv, the message) of one careless input."""
    same, link = tmp_path / "same.png", tmp_path / "link.json"
    if case == "huge line":
        huge = tmp_path / "huge.txt"
        huge.write_text("a red fox\n" + "x" * (1 << 20) + "\nanother\n" + "y" * 20_000 + "\n")
        return ["--prompts", str(huge)], (
            f"--prompts {huge}: line 2 is 1,048,576 bytes; a prompt is at most 16,384 bytes (UTF-8); "
            f"--prompts {huge}: line 4 is 20,000 bytes"
        )
    if case == "device":
        return ["--report", "/dev/full", "--overwrite"], "--report /dev/full is not a regular file"
    if case == "directory of prompts":
        return ["--prompts", str(tmp_path)], f"--prompts {tmp_path} is not a regular file"
    if case == "same file":
        return ["--output", str(same), "--report", str(same)], f"--report {same} and --output {same} are the same"
    if case == "linked file":
        link.symlink_to(same)
        return ["--output", str(same), "--report", str(link)], f"--report {link} and --output {same} are the same"
    if case == "a prompt's file":
        (tmp_path / "prompts.txt").write_text("one\ntwo\n")
        report = tmp_path / "same-001.png"
        argv = ["--prompts", str(tmp_path / "prompts.txt"), "--output", str(same), "--report", str(report)]
        return argv, f"--report {report} is --output {same}'s file for prompt 1; name two files"
    if case == "Ulysses group over the world":
        return ["--sequence-parallel", "2"], (  # the option's older name: the problem says its name
            "--ulysses 2: a world of 1 rank cannot be cut into Ulysses groups of 2: 2 must divide 1"
        )
    if case == "Ulysses group over the heads":  # the demo's transformer: 4 query heads, 2 key/value heads
        return ["--nproc-per-node", "3", "--ulysses", "3"], (
            "--ulysses 3: a Ulysses degree of 3 cannot split this transformer's attention: it has 4 query heads "
            "and 2 key/value heads (the demo's transformer config)"
        )
    if case == "Ulysses group on no pipeline":
        fixture = Path(__file__).parents[1] / "fixtures" / "modelopt-0.47-cosmos3-transformer"
        return ["--nproc-per-node", "2", "--ulysses", "2", "--checkpoint", str(fixture)], (
            f"--ulysses 2 splits a diffusers pipeline's transformer; {fixture} has no model_index.json"
        )
    assert case == "timeout"
    return ["--timeout", "inf"], "--timeout must be <= 86,400 seconds (a day), got inf"


CARELESS = [
    "huge line",
    "device",
    "directory of prompts",
    "same file",
    "linked file",
    "a prompt's file",
    "timeout",
    "Ulysses group over the world",
    "Ulysses group over the heads",
    "Ulysses group on no pipeline",
]


@pytest.mark.parametrize("case", CARELESS)
def test_careless_inputs_are_one_usage_error(tmp_path, capsys, case):
    """A prompt that would never finish its first step, a report into a device, a report that
    would replace the image, a timeout no backend takes: each one usage error (exit 2) naming
    the option and the bound or the clash (before torch: the last test of this file)."""
    argv, message = _careless(tmp_path, case)
    err = _usage_error(argv, capsys)
    assert message in err and err.count("error:") == 1, err
    assert not (tmp_path / "same.png").exists()


def test_a_prompts_file_above_its_bound_is_refused_unread(tmp_path, capsys, monkeypatch):
    from fsdp_fp8.generation import prompts as prompts_module

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\n" * 100)
    monkeypatch.setattr(prompts_module, "MAX_PROMPTS_FILE_BYTES", 999)
    err = _usage_error(["--prompts", str(prompts)], capsys)
    assert f"--prompts {prompts} is 1,000 bytes; a prompts file is at most 999 bytes" in err


def test_a_report_that_cannot_be_written_is_one_error_line(tmp_path):
    from fsdp_fp8.cli.outputs import write_report

    assert write_report(str(tmp_path / "r.json"), {"a": 1}) is None
    assert (tmp_path / "r.json").read_text() == '{\n  "a": 1\n}'
    assert write_report("/dev/full", {"a": 1}) == "--report /dev/full: cannot write the report: No space left on device"


# --- what --checkpoint names, and the sizes its pipeline can make: refused before torch -------


def _pipeline_root(root: Path, vae: dict, transformer: dict) -> Path:
    """A pipeline root as the launcher's parse step sees it: the index, the two configs it reads
    and a transformer checkpoint file (its contents are the load's to check)."""
    import json

    (root / "vae").mkdir(parents=True)
    (root / "transformer").mkdir()
    (root / "model_index.json").write_text(json.dumps({"_class_name": "Cosmos3OmniPipeline"}))
    (root / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan", **vae}))
    (root / "transformer" / "config.json").write_text(json.dumps(transformer))
    (root / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    return root


WAN = {"scale_factor_spatial": 16, "scale_factor_temporal": 4}


SIZES = [
        (None, None, ["--height", "33", "--width", "33"], "--height 33 is not a multiple of 4 (`scale_factor_spatial` 4 "
         "in the demo's VAE): use 32 or 36; --width 33 is not a multiple of 4"),
        (None, None, ["--frames", "2"], "--frames 2 is not 1 + a multiple of 4 (`scale_factor_temporal` 4 in the "
         "demo's VAE: the VAE makes 1, 5, 9, ... frames): use 1 or 5"),
        (WAN, {"latent_patch_size": 2}, ["--height", "720", "--width", "1000", "--frames", "93"],
         "--width 1000 is not a multiple of 16 (`scale_factor_spatial` 16 in ROOT/vae/config.json): use 992 or 1008"),
        (WAN, {"latent_patch_size": 2}, ["--height", "8"], "--height 8 is not a multiple of 16 (`scale_factor_spatial` "
         "16 in ROOT/vae/config.json): use 16"),
        ({**WAN, "scale_factor_spatial": 0}, {"latent_patch_size": 2}, ["--height", "64"],
         "--checkpoint: ROOT/vae/config.json: `scale_factor_spatial` is 0; it must be an integer >= 1"),
        ({**WAN, "scale_factor_temporal": None}, {"latent_patch_size": 2}, [],
         "--checkpoint: ROOT/vae/config.json: `scale_factor_temporal` is None; it must be an integer >= 1"),
        (WAN, {"latent_patch_size": 0}, [], "--checkpoint: ROOT/transformer/config.json: `latent_patch_size` is 0"),
]  # fmt: skip


@pytest.mark.parametrize("vae, transformer, argv, message", SIZES)
def test_sizes_the_pipeline_cannot_make_are_refused(tmp_path, capsys, vae, transformer, argv, message):
    """The pipeline's own check (height and width multiples of its VAE's factor) came after the
    load; a frame count the VAE cannot make was silently rounded down; a factor of 0 divided."""
    argv, message = _sizes(tmp_path, vae, transformer, argv, message)
    err = _usage_error(argv, capsys)
    assert message in err and err.count("error:") == 1, err


def _sizes(tmp_path: Path, vae, transformer, argv: list[str], message: str) -> tuple[list[str], str]:
    if vae is None:  # the demo's
        return argv, message
    root = _pipeline_root(tmp_path / "root", vae, transformer)
    return ["--checkpoint", str(root), *argv], message.replace("ROOT", str(root))


def test_sizes_the_pipeline_can_make_pass(tmp_path):
    root = _pipeline_root(tmp_path / "root", WAN, {"latent_patch_size": 2})
    args = parse_args(["--checkpoint", str(root), "--height", "720", "--width", "1264", "--frames", "93"])
    assert (args.height, args.width, args.frames) == (720, 1264, 93)  # 1264 = 16 x 79: the patches pad
    assert parse_args(["--height", "36", "--width", "36", "--frames", "5"]).frames == 5  # the demo's VAE


NOT_THERE = ["missing", "relative", "file", "pickles", "empty"]


def _not_there(tmp_path: Path, case: str) -> tuple[str, str]:
    """(a --checkpoint that names no checkpoint, the message), looked up from ``tmp_path/work``
    with the hub cache ``tmp_path/hub``."""
    (tmp_path / "work").mkdir(exist_ok=True)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not really a pickle")
    return {
        "missing": (str(tmp_path / "nowhere"), f"--checkpoint: checkpoint directory {tmp_path / 'nowhere'} does "
                    "not exist"),
        "relative": ("fixtures/modelopt-0.47-llama-tied", f"--checkpoint: 'fixtures/modelopt-0.47-llama-tied': no "
                     f"such directory (relative to {tmp_path / 'work'}), and no complete snapshot of "
                     f"fixtures/modelopt-0.47-llama-tied in the local Hugging Face cache {tmp_path / 'hub'}"),
        "file": (__file__, f"--checkpoint: checkpoint path {__file__} is not a directory"),
        "pickles": (str(tmp_path), f"--checkpoint: {tmp_path}: only pickle checkpoint files ['pytorch_model.bin']"),
        "empty": (str(tmp_path / "work"), f"--checkpoint: {tmp_path / 'work'}: no safetensors checkpoint"),
    }[case]  # fmt: skip


@pytest.mark.parametrize("case", NOT_THERE)
def test_a_checkpoint_that_is_not_there_is_one_usage_error(tmp_path, capsys, monkeypatch, case):
    """A path the load would refuse only after torch and the process group were up is one usage
    error naming --checkpoint; a path-looking name that is no directory says it is in neither
    place it was looked for, without the hub library's advice (no CLI user can pass its flag)."""
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    path, message = _not_there(tmp_path, case)
    monkeypatch.chdir(tmp_path / "work")
    err = _usage_error(["--checkpoint", path], capsys)
    assert message in err and err.count("error:") == 1, err
    assert "raised at" not in err and "local_files_only" not in err and not re.search(r"\.py:\d", err), err


def test_every_careless_input_is_refused_before_torch_is_imported(tmp_path):
    """The cases above, each in one fresh interpreter: exit 2 before torch (or safetensors,
    diffusers) is imported, so a mistake costs the time of --help on every rank."""
    import json

    def new(name: str) -> Path:
        (tmp_path / name).mkdir()
        return tmp_path / name

    cases = [_careless(new(f"careless-{i}"), case)[0] for i, case in enumerate(CARELESS)]
    cases += [_sizes(new(f"sizes-{i}"), *case)[0] for i, case in enumerate(SIZES)]
    cases += [["--checkpoint", _not_there(new(f"path-{i}"), c)[0]] for i, c in enumerate(NOT_THERE)]
    code, err, heavy = _refusal_without_torch(
        [json.dumps(cases)], env={"HF_HUB_CACHE": str(tmp_path / "hub")}, cwd=tmp_path / "path-1" / "work", many=True
    )
    assert code == [2] * len(cases), err
    assert heavy == [] and "Traceback" not in err, (heavy, err[-3000:])
