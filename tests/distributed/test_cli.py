"""``fsdp-fp8`` / ``python -m fsdp_fp8``, in process: the subcommands, their option checks, and
``verify`` deciding exactly as ``load_model`` does on every fixture."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from small_models import write_uneven_checkpoint

from fsdp_fp8.cli import commands as cli
from fsdp_fp8.errors import CheckpointError

FIXTURES = sorted(p for p in (Path(__file__).parents[1] / "fixtures").iterdir() if p.name.startswith("modelopt-"))
NEEDS_HF = {p.name for p in FIXTURES}  # transformers / diffusers classes


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Every fixture, plus our own kinds: a reference-MoT FP8 export (its 88-row MLP cannot
    run on CUDA's _scaled_mm) and a checkpoint whose config names no model class."""
    from fsdp_fp8.export.modelopt import export_fp8
    from fsdp_fp8.models import PRESETS, build_model, init_weights

    root = tmp_path_factory.mktemp("cli")
    model = init_weights(build_model(PRESETS["tiny"], device="cpu"), seed=0)
    mot = export_fp8(
        model,
        root / "mot-tiny",
        config=model.config.to_config_dict(),
        input_scales={n: 0.01 for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"},
        ignore=("lm_head",),
    )
    return {
        **{p.name: p for p in FIXTURES},
        "mot-tiny": Path(mot),
        "no-model-class": write_uneven_checkpoint(root / "uneven"),
    }


def _load_verdict(path: Path, device: str) -> CheckpointError | None:
    """What load_model decides: a CheckpointError is its refusal, raised on every rank before
    anything is built or read. Past it, a CPU-only torch fails at the first CUDA allocation,
    which is not a verdict on the checkpoint."""
    from fsdp_fp8 import load_model

    try:
        load_model(None, path, device=torch.device(device))
    except CheckpointError as exc:
        return exc
    except Exception:
        if device == "cuda" and not torch.cuda.is_available():
            return None
        raise
    return None


CASES = [p.name for p in FIXTURES] + ["mot-tiny", "no-model-class"]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", CASES)
def test_verify_agrees_with_load_model(checkpoints, capsys, name, device):
    if name in NEEDS_HF:
        pytest.importorskip("transformers")
        pytest.importorskip("diffusers")
    path = checkpoints[name]
    code = cli.main(["verify", str(path), "--device", device])
    out, err = capsys.readouterr()
    refused = _load_verdict(path, device)
    assert (code != 0) == (refused is not None), (code, out, err, refused)
    if refused is None:
        assert out.startswith(f"OK: {path} loads onto {device} as ") and "cannot load" not in err, (out, err)
    else:
        assert code == 1 and not out.startswith("OK")
        assert f"cannot load {path} onto {device}: " in err
        assert all(p in err for p in refused.problems), (refused.problems, err)


def test_the_refusals_verify_reports(checkpoints, capsys):
    """The cases above are not all alike: which fixture is refused where, and why."""
    assert cli.main(["verify", str(checkpoints["mot-tiny"]), "--device", "cpu"]) == 0
    assert "as ReferenceMoTTransformer (mot): 32 FP8 linears" in capsys.readouterr().out
    assert cli.main(["verify", str(checkpoints["mot-tiny"]), "--device", "cuda"]) == 1
    assert "`layers.0.mlp.gate_proj` is an FP8 linear of shape (88, 64)" in capsys.readouterr().err
    assert cli.main(["verify", str(checkpoints["no-model-class"]), "--device", "cpu"]) == 1
    assert "names no model class" in capsys.readouterr().err
    pytest.importorskip("transformers")
    assert cli.main(["verify", str(checkpoints["modelopt-0.47-qwen3-moe"]), "--device", "cpu"]) == 1
    assert "fused expert parameters" in capsys.readouterr().err
    assert (
        cli.main(["verify", str(checkpoints["modelopt-0.47-llama-sharded"]), "--world-size", "3", "--device", "cpu"])
        == 0
    )
    out = capsys.readouterr().out
    assert "as LlamaForCausalLM (causal_lm): 14 FP8 linears" in out
    assert out.count(" of 3: reads ") == 3


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: fsdp-fp8 ")
    for command in ("run", "inspect", "verify", "save"):
        assert f"\n    {command} " in out, out


def test_run_help_is_the_launchers(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--checkpoint" in out and "--steps" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect", "x", "--world-size", "0"], "argument --world-size: must be >= 1, got 0"),
        (["verify", "x", "--world-size", "-2"], "argument --world-size: must be >= 1, got -2"),
        (["verify", "x", "--device", "mps"], "argument --device: invalid choice: 'mps'"),
        (["frobnicate"], "argument command: invalid choice: 'frobnicate'"),
        (["inspect", "x", "--replicas", "2"], "--replicas 2 needs --world-size"),
        (["verify", "x", "--world-size", "4", "--replicas", "3"], "--replicas 3 does not divide --world-size 4"),
        (["inspect", "x", "--world-size", "4", "--replicas", "0"], "argument --replicas: must be >= 1, got 0"),
        ([], "the following arguments are required: command"),
        (["save", "a", "b", "--timeout", "inf"], "--timeout must be <= 86,400 seconds (a day), got inf"),
        (["save", "a", "b", "--timeout", "0"], "--timeout must be > 0, got 0.0"),
        (["save", "/nonexistent/source", "b"], "SOURCE: checkpoint directory /nonexistent/source does not exist"),
    ],
)
def test_bad_options_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def _figures(out: str) -> list[str]:
    """The per-rank (or per-shard) figures of a forecast, without the line's label."""
    return [line.split(":", 1)[1] for line in out.splitlines() if ": reads " in line]


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_the_hsdp_forecast_is_one_line_per_shard_with_its_ranks(checkpoints, capsys, command):
    """Under HSDP (2 replicas of 2 ranks) a rank reads what the rank at its shard coordinate reads
    in a 2-rank job: the forecast shows each shard once, with the two ranks holding it."""
    path, extra = str(checkpoints["mot-tiny"]), (["--device", "cpu"] if command == "verify" else [])
    assert cli.main([command, path, "--world-size", "2", *extra]) == 0
    flat = capsys.readouterr().out
    assert cli.main([command, path, "--world-size", "4", "--replicas", "2", *extra]) == 0
    hsdp = capsys.readouterr().out
    assert "HSDP 2 x 2 (replicate x shard)" in hsdp
    assert "shard 0 (ranks 0, 2)" in hsdp and "shard 1 (ranks 1, 3)" in hsdp
    assert len(_figures(hsdp)) == 2 and _figures(hsdp) == _figures(flat)


def _without_torch(argv: list[str], watched=("torch", "torchao", "numpy")) -> tuple[int, str, str, list[str]]:
    """``fsdp-fp8 ARGV`` in a fresh interpreter: (exit code, stdout, stderr, the first 3 modules
    imported of the packages ``watched``)."""
    import json
    import subprocess
    import sys

    code = (
        "import io, json, sys\n"
        "watched = tuple(json.loads(sys.argv.pop(1)))\n"
        "from contextlib import redirect_stdout\n"
        "from fsdp_fp8.cli.commands import main\n"
        "out = io.StringIO()\n"
        "try:\n    with redirect_stdout(out):\n        code = main(sys.argv[1:])\n"
        "except SystemExit as e:\n    code = e.code\n"
        "found = sorted(m for m in sys.modules if m in watched or m.startswith(tuple(w + '.' for w in watched)))\n"
        "print(json.dumps([code, out.getvalue(), found[:3]]))\n"
    )
    argv = [json.dumps(list(watched)), *argv]
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    exit_code, out, modules = json.loads(proc.stdout.strip().splitlines()[-1])
    return exit_code, out, proc.stderr, modules


@pytest.mark.parametrize(
    "argv, exit_code",
    [
        (["--help"], 0),
        (["run", "--help"], 0),
        (["inspect", "--help"], 0),
        (["verify", "--help"], 0),
        (["save", "--help"], 0),
        (["inspect", "x", "--world-size", "0"], 2),
        (["frobnicate"], 2),
        (["run", "--steps", "0", "--output", "x.gif"], 2),
        (["run", "--frobnicate"], 2),
        (["save", "/nonexistent/source", "/tmp/never-written"], 2),
    ],
)
def test_help_and_usage_errors_do_not_import_torch(argv, exit_code):
    code, out, err, modules = _without_torch(argv)
    assert code == exit_code, (out, err)
    assert modules == [], modules
    text = out + err
    assert text.strip() and "docs/usage.md" not in text and "``" not in text, text  # self-contained plain text


@pytest.mark.parametrize("frames", ["189", "1000000000"])
def test_inspect_on_a_pipeline_root_imports_neither_diffusers_nor_dynamo(demo_root, frames):
    """The VAE's phases come from its config's arithmetic: ``inspect`` imports no diffusers and no
    torch._dynamo (seconds each, against its budget of 2 s: docs/usage.md), at any frame count."""
    size = ["--height", "720", "--width", "1280", "--frames", frames]
    code, out, err, modules = _without_torch(["inspect", str(demo_root), *size], ("diffusers", "torch._dynamo"))
    assert code == 0, (out, err)
    assert "VAE decode, tiled" in out and "VAE figures: the config's arithmetic" in out, out
    assert modules == [], modules


def test_verify_warns_on_a_checkpoint_without_fp8_and_fails_behind_a_flag(tmp_path, capsys):
    from fsdp_fp8.export.modelopt import export_bf16
    from fsdp_fp8.models import PRESETS, build_model, init_weights

    model = init_weights(build_model(PRESETS["tiny"], device="cpu"), seed=0)
    plain = export_bf16(model, tmp_path / "bf16", config=model.config.to_config_dict())
    assert cli.main(["verify", str(plain), "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "0 FP8 linears" in out and f"warning: {plain} has no FP8 linear" in err
    assert " 1 files" not in out and "in 1 file" in out
    assert cli.main(["verify", str(plain), "--device", "cpu", "--require-fp8"]) == cli.NO_FP8_EXIT == 3
    capsys.readouterr()


def test_verify_and_inspect_wording(checkpoints, capsys):
    """Plurals, zero counts left out, no line longer than a terminal except the per-rank rows."""
    assert cli.main(["verify", str(checkpoints["mot-tiny"]), "--device", "cpu", "--require-fp8"]) == 0
    out, err = capsys.readouterr()
    assert "warning" not in err and "KV-cache" not in out
    assert cli.main(["inspect", str(checkpoints["mot-tiny"]), "--world-size", "3"]) == 0
    out = capsys.readouterr().out
    assert "k/v scale" not in out and "1 files" not in out
    assert all(len(line) <= 100 for line in out.splitlines() if ": reads " not in line), out
    assert "staging ring: host buffers" in out and "prefetch: page-cache hints" in out
    bounce = re.search(r"O_DIRECT bounce: .* holds at most (\d+) x\s+([\d,]+)\s+bytes .*= ([\d,]+) bytes", out, re.S)
    assert bounce, out
    count, each, total = (int(g.replace(",", "")) for g in bounce.groups())
    assert count * each == total and each % 4096 == 0 and 8192 <= each, bounce.group(0)


# --- inspect: configs it divides by, a world size it can list, a user's words ------------------


def _edited(root: Path, to: Path, config: str, key: str, value) -> Path:
    import json
    import shutil

    shutil.copytree(root, to)
    data = json.loads((to / config).read_text())
    if value is ...:
        del data[key]
    else:
        data[key] = value
    (to / config).write_text(json.dumps(data))
    return to


@pytest.mark.parametrize(
    "config, key, value, problem",
    [
        ("vae/config.json", "scale_factor_spatial", 0, "`scale_factor_spatial` is 0; it must be an integer >= 1"),
        ("vae/config.json", "scale_factor_spatial", None, "`scale_factor_spatial` is None; it must be an integer"),
        ("vae/config.json", "scale_factor_temporal", "4", "`scale_factor_temporal` is '4'; it must be an integer"),
        ("transformer/config.json", "latent_patch_size", 0, "`latent_patch_size` is 0; it must be an integer >= 1"),
        ("transformer/config.json", "latent_patch_size", ..., "`latent_patch_size` is missing"),
        ("transformer/config.json", "hidden_size", -64, "`hidden_size` is -64; it must be an integer >= 1"),
    ],
)
def test_inspect_refuses_a_config_it_would_divide_by(demo_root, tmp_path, capsys, config, key, value, problem):
    """Were ZeroDivisionError / TypeError / KeyError tracebacks: now one error naming the file."""
    root = _edited(demo_root, tmp_path / "root", config, key, value)
    assert cli.main(["inspect", str(root), "--height", "64"]) == 1
    out, err = capsys.readouterr()
    assert err.count("error:") == 1 and f"{root / config}: {problem}" in err, err
    assert "memory forecast" not in out


def test_inspect_caps_the_world_size_and_summarises_many_ranks(checkpoints, capsys):
    path = str(checkpoints["mot-tiny"])
    with pytest.raises(SystemExit) as exit_:
        cli.main(["inspect", path, "--world-size", "1000000"])
    assert exit_.value.code == 2
    assert "--world-size: must be <= 65,536 (the most ranks a forecast is made for), got 1,000,000" in (
        capsys.readouterr().err
    )
    assert cli.main(["inspect", path, "--world-size", "16"]) == 0
    assert len(_figures(capsys.readouterr().out)) == 16  # every rank, up to 16
    assert cli.main(["inspect", path, "--world-size", "65536"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("  rank ")]
    assert [r.split(":")[0] for r in rows] == ["  rank 0", "  rank 65535"], out
    assert "  ... 65,534 ranks between: each reads between these two and holds the same" in out

    def read(row: str) -> int:
        return int(row.split("reads ")[1].split(" bytes")[0].replace(",", ""))

    assert read(rows[0]) >= read(rows[1])  # rank 0 reads the most, the last rank the least
    assert cli.main(["verify", path, "--device", "cpu", "--world-size", "4096", "--replicas", "512"]) == 0
    out = capsys.readouterr().out
    assert "shard 0 (512 ranks: 0, 8, ..., 4088) of 8: reads" in out and out.count(" of 8: reads ") == 8


def test_inspect_speaks_in_a_users_words(demo_root, capsys):
    """The step policy's windows, a prefetch no larger than what a rank reads, a phrase once."""
    assert cli.main(["inspect", str(demo_root), "--world-size", "2", "--height", "64"]) == 0
    out = capsys.readouterr().out
    assert "step policy:     W8A16 steps 0-2 and the last 3 (W8A8 between), reasoner W8A16" in out
    prefetch = " ".join(line.strip() for line in out.split("  prefetch: ")[1].split("\n  rank 0")[0].splitlines())
    hinted = int(prefetch.split("at most ")[1].split(" bytes")[0].replace(",", ""))
    total = int(out.split("files:")[1].split(" bytes")[0].split(", ")[-1].replace(",", ""))
    assert 0 < hinted < total and prefetch.endswith("per rank (every row it reads)"), prefetch
    activations = next(line for line in out.splitlines() if line.strip().startswith("activations"))
    widest = activations.split("widest: ")[1].split(" ")[0]
    assert activations.count(widest) == 1, activations


def test_the_launchers_status_is_the_first_failed_ranks_own():
    """Of ranks torch's agent saw fail within one second by its whole-second stamps, the one a
    signal ended (killed) came first, not the peer that exited 1 on seeing it go: the killed rank
    is stamped when the agent saw it, which can be the next second (the suite's launcher test of a
    rank killed mid-loop once exited 1 so). Otherwise the earliest, then the lowest rank."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from fsdp_fp8.cli.spawn import _exit_status, first_failure

    def failed(rank: int, code: int, stamp: int) -> ProcessFailure:
        failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="")
        failure.timestamp = stamp
        return failure

    same_second = {0: failed(0, 1, 7), 1: failed(1, -9, 7)}
    assert _exit_status(first_failure(same_second).exitcode) == 137
    stamped_the_next_second = {0: failed(0, 1, 6), 1: failed(1, -9, 7)}
    assert _exit_status(first_failure(stamped_the_next_second).exitcode) == 137
    earlier = {0: failed(0, 1, 5), 1: failed(1, -9, 7)}
    assert _exit_status(first_failure(earlier).exitcode) == 1
    assert _exit_status(first_failure({0: failed(0, 1, 6), 1: failed(1, 3, 7)}).exitcode) == 1
    assert first_failure({0: failed(0, 2, 7), 1: failed(1, 1, 7)}).local_rank == 0
