"""``--vae-tiling`` through the launcher: at SP 2, CFG 2 (2-rank requests) and CFG 2 x SP 2 (a
4-rank request) the saved frames equal the pipeline's own ``enable_tiling()`` decode on one
process, byte for byte; ``off`` keeps the pipeline's own untiled decode and the latent digest.

The demo pipeline at 288 x 288 pixels: a 72 x 72 latent, four tiles of diffusers' default size
(64 latent pixels every 48), so ``on`` really tiles and really splits; and the pipeline built
around the real ModelOpt fixture (tests/distributed/test_cfg_parallel.py's) at CFG 2 x SP 2, at
264 x 200 pixels: a 50 x 66 latent, the fewest tokens that still make four tiles (its FP8
``proj_in`` and ``time_embedder`` run W8A8 at every step, outside both towers, on every generation
token: CPU's slow ``torch._scaled_mm``). The reference is ``Cosmos3OmniPipeline.__call__`` itself
with ``vae.enable_tiling()``, saved as the launcher saves.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest
import torch

pytest.importorskip("diffusers")
pytestmark = pytest.mark.timeout(900)

from ranks import run_ranks  # noqa: E402

SIZE = {"num_frames": 1, "height": 288, "width": 288}
# latent 50 x 66: past one tile's 64 in width, tile rows and columns start at 0 and 48 (four tiles);
# 825 generation tokens a pass, not 1,296
FIXTURE_SIZE = {"num_frames": 1, "height": 200, "width": 264}
STEPS = 2
PROMPT = "a red fox"
LAYOUTS = {
    "sp2": ["--sequence-parallel", "2"],
    "cfg2": ["--cfg-parallel"],
    "cfg2xsp2": ["--cfg-parallel", "--sequence-parallel", "2"],
}


def _argv(root: str, out: Path, tiling: str, extra: list[str], sizes: dict = SIZE) -> list[str]:
    size = ["--frames", "1", "--height", str(sizes["height"]), "--width", str(sizes["width"])]
    return ["--checkpoint", root, *size, "--steps", str(STEPS), "--prompt", PROMPT, "--vae-tiling", tiling] + [
        "--output",
        str(out / "frames.png"),
        "--report",
        str(out / "report.json"),
        *extra,
    ]


def _launch(rank: int, world: int, root: str, fixture_root: str, base: str) -> dict:
    from fsdp_fp8.cli.runner import main

    got = {}
    env = {"RANK": str(rank), "WORLD_SIZE": str(world)} if world > 1 else {}
    runs = {name: (root, "on", extra, SIZE) for name, extra in LAYOUTS.items()} if world > 1 else {}
    runs |= {"fixture": (fixture_root, "on", LAYOUTS["cfg2xsp2"], FIXTURE_SIZE)} if world > 1 else {}
    runs |= {"off": (root, "off", [], SIZE), "auto": (root, "auto", [], SIZE)} if world == 1 else {}
    with mock.patch.dict(os.environ, env):
        for name, (root, tiling, extra, size) in runs.items():
            out = Path(base, f"{name}-{world}")
            out.mkdir(exist_ok=True)
            assert main(_argv(root, out, tiling, extra, size)) == 0
            if rank == 0:
                report = json.loads((out / "report.json").read_text())
                got[name] = {"png": (out / "frames.png").read_bytes(), "row": report["outputs"][0]}
    return got


def _reference(root: str, out: Path, size: dict = SIZE) -> bytes:
    """The pipeline's own tiled decode on this process, saved as the launcher saves: on one intra-op
    thread, as the launcher decodes on CPU (frames thread-invariant: test_decode_threads.py)."""
    from fsdp_fp8 import load_pipeline
    from fsdp_fp8.generation.engine import save_frames

    pipe = load_pipeline(root, device=torch.device("cpu"))
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.enable_tiling()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        video = pipe(
            PROMPT, **size, num_inference_steps=STEPS, guidance_scale=3.0, generator=torch.Generator().manual_seed(0)
        ).video
    finally:
        torch.set_num_threads(threads)
    out.mkdir(exist_ok=True)
    save_frames(list(video), out / "reference.png", 24.0)
    return (out / "reference.png").read_bytes()


def _fixture_root(demo_root, tmp_path):
    """The demo pipeline with the real ModelOpt fixture as its transformer (test_cfg_parallel's)."""
    from pipelines import pipeline_beside_the_demo

    return pipeline_beside_the_demo(demo_root, tmp_path / "fixture-root")


@pytest.fixture(scope="module")
def runs(demo_root, tmp_path_factory):
    base = tmp_path_factory.mktemp("vae-wiring")
    fixture = _fixture_root(demo_root, base)
    with mock.patch.dict(os.environ, {"FSDP_FP8_CACHE": str(demo_root.parent)}):
        one = _launch(0, 1, str(demo_root), fixture, str(base))
        four = run_ranks(_launch, 4, str(demo_root), fixture, str(base), timeout=800)[0]
        refs = {
            "reference": _reference(str(demo_root), base / "demo"),
            "fixture": _reference(fixture, base / "fixture", FIXTURE_SIZE),
        }
        return {**refs, "one": one, "four": four}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_split_decode_frames_equal_the_pipelines_own_tiled_decode(runs, layout):
    ranks = 4 if layout == "cfg2xsp2" else 2
    got = runs["four"][layout]
    assert got["row"]["vae_decode"] == f"tiled, split over {ranks} ranks"
    assert got["png"] == runs["reference"]
    assert got["row"]["latent_sha256"] == runs["one"]["off"]["row"]["latent_sha256"]


def test_the_fixture_pipelines_split_decode_equals_its_own_tiled_decode(runs):
    got = runs["four"]["fixture"]
    assert got["row"]["vae_decode"] == "tiled, split over 4 ranks"
    assert got["png"] == runs["fixture"]


def test_off_keeps_the_pipelines_own_untiled_decode(runs):
    off = runs["one"]["off"]
    assert off["row"]["vae_decode"] == "untiled, on the writing rank"  # the pipeline's own untiled decode
    assert off["png"] != runs["reference"]  # untiled and tiled frames differ: the test can tell them apart


def test_auto_where_the_untiled_decode_fits_gives_the_same_bytes_as_off(runs):
    auto, off = runs["one"]["auto"], runs["one"]["off"]
    assert auto["row"]["vae_decode"] == "untiled"  # a 288 x 288 frame fits this machine's memory
    assert auto["png"] == off["png"] and auto["row"]["latent_sha256"] == off["row"]["latent_sha256"]


def test_vae_tiling_takes_its_three_words_and_refuses_others_before_the_load(capsys):
    from fsdp_fp8.cli.arguments import parse_run_args
    from fsdp_fp8.generation.values import VAE_TILING
    from fsdp_fp8.runtime.vae_forecast import MODES

    assert VAE_TILING == MODES
    with pytest.raises(SystemExit) as exit_:
        parse_run_args(["--vae-tiling", "always"])
    assert exit_.value.code == 2 and "--vae-tiling: invalid choice: 'always'" in capsys.readouterr().err


def _run_one(argv: list[str], report: Path, caplog) -> dict:
    from fsdp_fp8.cli.runner import main

    with caplog.at_level("WARNING", logger="fsdp_fp8"):
        assert main([*argv, "--report", str(report)]) == 0
    return json.loads(report.read_text())


def test_sound_with_tiling_on_decodes_the_frames_as_asked_and_the_report_names_it(demo_root, tmp_path, caplog, capsys):
    """``--sound --vae-tiling on`` (issue 49): the split decode takes the frames, the pipeline the
    track, and the report names the decode that ran; ``--vae-tiling`` without ``--output`` (nothing
    decoded) is said to be ignored, once."""
    # 2 steps: W8A16 under the demo's policy (a one-step request stays W8A8, CPU's slow torch._scaled_mm)
    size = ["--checkpoint", str(demo_root), "--frames", "5", "--height", "32", "--width", "32", "--steps", "2"]
    out = tmp_path / "fox.mp4"
    result = _run_one([*size, "--sound", "--vae-tiling", "on", "--output", str(out)], tmp_path / "a.json", caplog)
    row = result["outputs"][0]
    assert row["sound_sha256"] and out.stat().st_size > 0
    assert row["vae_decode"].startswith("untiled (--vae-tiling on: the latent fits one"), row  # 32 x 32: one tile
    assert f"(VAE decode {row['vae_decode']})" in capsys.readouterr().out
    assert "ignored" not in caplog.text
    caplog.clear()
    result = _run_one([*size, "--sound", "--vae-tiling", "on"], tmp_path / "b.json", caplog)
    assert "vae_decode" not in result["outputs"][0]
    notes = [r.getMessage() for r in caplog.records if "--vae-tiling" in r.getMessage()]
    assert notes == [
        "--vae-tiling on chooses how an --output's frames are decoded; without --output nothing is decoded (the "
        "latents are digested as they are), so it is ignored"
    ]
