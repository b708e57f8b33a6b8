"""A pipeline root laid out as the published Cosmos 3 roots are: transformer, vae, sound tokenizer,
text tokenizer, scheduler, the Cosmos guardrail as its safety checker (on) and a root
``modelopt_state.pth``. Without the guardrail's package the run is refused before the load, naming
the package and ``--safety-check off``; with it off, the run gives the demo's latent, and the
``.pth`` (a pickle) is never unpickled."""

from __future__ import annotations

import importlib.util
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

GUARDRAIL = importlib.util.find_spec("cosmos_guardrail") is not None
ARGS = ("--steps", "2", "--frames", "1", "--height", "32", "--width", "32")


class _Tripwire:
    """Unpickled, it creates ``path``: proof that something unpickled the file."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def official(demo_root, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("official") / "Cosmos3-FP8"
    shutil.copytree(demo_root, root)
    index = json.loads((root / "model_index.json").read_text())
    index.update(safety_checker=["cosmos_guardrail", "CosmosSafetyChecker"], enable_safety_checker=True)
    (root / "model_index.json").write_text(json.dumps(index, indent=2))
    marker = root.parent / "unpickled"
    (root / "modelopt_state.pth").write_bytes(pickle.dumps(_Tripwire(str(marker))))
    listed = {k for k, v in index.items() if isinstance(v, list)}
    assert listed == {"transformer", "vae", "sound_tokenizer", "text_tokenizer", "scheduler", "safety_checker"}
    return root, marker


@pytest.mark.skipif(GUARDRAIL, reason="cosmos_guardrail is installed: the checker would run")
def test_the_guardrail_missing_is_one_line_naming_the_package_and_the_opt_out(official, capsys):
    from fsdp_fp8.cli.arguments import parse_run_args

    with pytest.raises(SystemExit) as exit_info:
        parse_run_args(["--checkpoint", str(official[0]), *ARGS])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "`cosmos_guardrail` is not installed (pip install cosmos_guardrail)" in err
    assert err.endswith("or run without it: --safety-check off")


@pytest.mark.skipif(GUARDRAIL, reason="cosmos_guardrail is installed: the checker would run")
def test_load_pipeline_refuses_the_missing_guardrail_before_the_load(official):
    from fsdp_fp8 import load_pipeline

    with pytest.raises(ValueError, match="enable_safety_checker=False, safety_checker=None"):
        load_pipeline(str(official[0]), device=torch.device("cpu"))


def test_with_the_check_off_the_official_layout_runs_as_the_demo(official, demo_root, tmp_path):
    from fsdp_fp8.cli.runner import main

    root, marker = official
    digests = []
    for checkpoint, extra in ((root, ("--safety-check", "off")), (demo_root, ())):
        report = tmp_path / f"{len(digests)}.json"
        assert main(["--checkpoint", str(checkpoint), *ARGS, *extra, "--report", str(report)]) == 0
        digests.append(json.loads(report.read_text())["latent_sha256"])
    assert digests[0] == digests[1]
    assert not marker.exists()  # modelopt_state.pth was never unpickled


def test_a_guardrail_module_inside_the_checkpoint_is_custom_code(official, tmp_path):
    from fsdp_fp8.interop.diffusers_pipeline import read_model_index

    root = tmp_path / "shadowed"
    shutil.copytree(official[0], root)
    (root / "cosmos_guardrail.py").write_text("raise SystemExit('never imported')\n")
    with pytest.raises(ValueError, match="`safety_checker` comes from module 'cosmos_guardrail'"):
        read_model_index(root)
    assert read_model_index(official[0])["safety_checker"] == ["cosmos_guardrail", "CosmosSafetyChecker"]
