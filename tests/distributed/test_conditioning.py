"""Image- and video-to-video and sound from the launcher: ``--image``, ``--video``, ``--sound`` and
JSON lines of ``--prompts``, each request's latent (and sound track) at 2 ranks (FSDP), CFG 2 and
SP 2 equal to one rank's; the report names each request's mode; careless inputs refused before
the load, one line, exit 2. The same on a pipeline around a real ModelOpt export of a
sound-capable transformer (tests/fixtures/modelopt-0.47-cosmos3-sound-transformer), where an mp4
``--video`` also gives the latent of its frames as a directory.

One spawn of 2 ranks runs the three layouts, each two launcher runs on the demo (every request
without sound, then sound alone and image + sound), one on the text-only fixture and two on the
sound fixture (image and video; sound and image + sound); one of 4 ranks CFG 2 x SP 2 (the demo's
and both fixtures' jobs) and HSDP 2 x 2 with CFG pairs.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

pytest.importorskip("diffusers")
pytestmark = pytest.mark.timeout(900)

from ranks import run_ranks  # noqa: E402

SIZE = ("--frames", "5", "--height", "32", "--width", "32", "--steps", "2")
LAYOUTS = {"fsdp": (), "cfg": ("--cfg-parallel",), "sp": ("--sequence-parallel", "2")}


def _picture(seed: int, size=(40, 48)):
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """An image, a directory of frames, an animated PNG, and a JSON-lines prompts file of them."""
    root = tmp_path_factory.mktemp("inputs")
    _picture(0).save(root / "still.png")
    (root / "clip").mkdir()
    for i in range(5):
        _picture(10 + i).save(root / "clip" / f"{i:03d}.png")
    frames = [_picture(20 + i) for i in range(9)]
    frames[0].save(root / "clip.png", save_all=True, append_images=frames[1:], duration=40)
    lines = [
        {"prompt": "a red fox", "image": "still.png"},
        {"prompt": "a lighthouse", "video": "clip", "seed": 3},
        {"prompt": "a cat", "video": "clip.png", "negative_prompt": "blurry"},
        "a red fox",  # a plain line: the first request without its image
    ]
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    (root / "requests.jsonl").write_text(text + "\n")
    (root / "sound.jsonl").write_text('a red fox\n{"prompt": "a red fox", "image": "still.png"}\n')
    _sound_fixture_inputs(root)
    return root


def _launch(root: str, report: Path, *extra: str, rank: int = 0) -> dict | None:
    from fsdp_fp8.cli.runner import main

    assert main(["--checkpoint", root, *SIZE, *extra, "--report", str(report)]) == 0
    return json.loads(report.read_text()) if rank == 0 else None


def _observe(
    rank: int, world: int, demo_root: str, fixture_root: str, inputs: str, reports: str, sound_root: str
) -> dict:
    env = {"RANK": str(rank), "WORLD_SIZE": str(world)}
    prompts = ("--prompts", str(Path(inputs, "requests.jsonl")))
    sound = ("--sound", "--prompts", str(Path(inputs, "sound.jsonl")))
    obs = {}
    with mock.patch.dict(os.environ, env):
        for name, extra in LAYOUTS.items():
            obs[name] = _launch(demo_root, Path(reports, f"{name}.json"), *prompts, *extra, rank=rank)
            obs[f"{name} sound"] = _launch(demo_root, Path(reports, f"{name}-sound.json"), *sound, *extra, rank=rank)
            report = Path(reports, f"{name}-fixture.json")
            obs[f"{name} fixture"] = _launch(fixture_root, report, *prompts, *extra, rank=rank)
            obs.update(_on_the_sound_fixture(sound_root, inputs, Path(reports, name), name, extra, rank))
    return obs


@pytest.fixture(scope="module")
def fixture_root(tmp_path_factory, demo_root) -> str:
    """The real ModelOpt 0.47 Cosmos 3 export beside the demo's VAE (test_cfg_parallel's pipeline)."""
    from pipelines import pipeline_beside_the_demo

    return pipeline_beside_the_demo(demo_root, tmp_path_factory.mktemp("fixture") / "root")


def _observe_four(
    rank: int, world: int, demo_root: str, fixture_root: str, inputs: str, reports: str, sound_root: str
) -> dict:
    """4 ranks: CFG 2 x SP 2 (one request on all four), and HSDP 2 x 2 with CFG pairs."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(world)}
    prompts = ("--prompts", str(Path(inputs, "requests.jsonl")))
    sound = ("--sound", "--prompts", str(Path(inputs, "sound.jsonl")))
    both = ("--cfg-parallel", "--sequence-parallel", "2")
    with mock.patch.dict(os.environ, env):
        fixture = _on_the_sound_fixture(sound_root, inputs, Path(reports, "4-cfg-sp"), "cfg sp", both, rank)
        return fixture | {
            "cfg sp": _launch(demo_root, Path(reports, "4-cfg-sp.json"), *prompts, *both, rank=rank),
            "cfg sp sound": _launch(demo_root, Path(reports, "4-cfg-sp-sound.json"), *sound, *both, rank=rank),
            "cfg sp fixture": _launch(fixture_root, Path(reports, "4-cfg-sp-fixture.json"), *prompts, *both, rank=rank),
            "hsdp cfg": _launch(
                demo_root, Path(reports, "4-hsdp.json"), *prompts, "--replicas", "2", "--cfg-parallel", rank=rank
            ),
        }


@pytest.fixture(scope="module")
def observed(demo_root, fixture_root, sound_fixture_root, inputs, tmp_path_factory):
    reports = tmp_path_factory.mktemp("reports")
    one_fixture_modes = _on_the_sound_fixture(sound_fixture_root, str(inputs), reports / "one", "one", ())
    one = _launch(str(demo_root), reports / "one.json", "--prompts", str(inputs / "requests.jsonl"))
    one_fixture = _launch(fixture_root, reports / "one-fixture.json", "--prompts", str(inputs / "requests.jsonl"))
    image = _launch(
        str(demo_root), reports / "image.json", "--prompt", "a red fox", "--image", str(inputs / "still.png")
    )
    mp4 = reports / "sound.mp4"
    sound = ("--sound", "--prompts", str(inputs / "sound.jsonl"), "--output", str(mp4))
    one_sound = _launch(str(demo_root), reports / "one-sound.json", *sound)
    paths = (str(inputs), str(reports), sound_fixture_root)
    ranks = run_ranks(_observe, 2, str(demo_root), fixture_root, *paths, timeout=900)
    ranks[0].update(run_ranks(_observe_four, 4, str(demo_root), fixture_root, *paths, timeout=900)[0])
    return one_fixture_modes | {
        "one": one,
        "one fixture": one_fixture,
        "image": image,
        "one sound": one_sound,
        "ranks": ranks[0],
        "mp4": reports,
    }


def _digests(report: dict) -> list[str]:
    return [row["latent_sha256"] for row in report["outputs"]]


def _sounds(report: dict) -> list[str]:
    return [row.get("sound_sha256") for row in report["outputs"]]


@pytest.mark.parametrize("layout", [*sorted(LAYOUTS), "cfg sp", "hsdp cfg"])
def test_every_mode_gives_the_one_rank_latent_on_every_layout(observed, layout):
    assert _digests(observed["ranks"][layout]) == _digests(observed["one"])


# The fixture's 2 query heads leave one per rank under SP 2: its attention is one item of CPU
# SDPA's work (tests/unit/test_ulysses_attention.py; interop.ulysses.full_attention).
@pytest.mark.parametrize("layout", ["cfg", "fsdp", "sp", "cfg sp"])
def test_every_mode_on_the_modelopt_fixture_gives_the_one_rank_latent(observed, layout):
    one = _digests(observed["one fixture"])
    assert len(set(one)) == len(one)
    assert _digests(observed["ranks"][f"{layout} fixture"]) == one


@pytest.mark.parametrize("layout", [*sorted(LAYOUTS), "cfg sp"])
def test_sound_and_image_with_sound_give_the_one_rank_latent_and_track_on_every_layout(observed, layout):
    one, ranks = observed["one sound"], observed["ranks"][f"{layout} sound"]
    assert all(_sounds(one)) and len(set(_sounds(one))) == 2
    assert _digests(ranks) == _digests(one) and _sounds(ranks) == _sounds(one)
    assert [row["mode"] for row in one["outputs"]] == [
        "text-to-video, 5 frames, sound",
        "image-to-video, 5 frames, sound",
    ]


def test_the_sound_is_muxed_into_the_mp4(observed):
    import av

    for index in (0, 1):
        with av.open(str(observed["mp4"] / f"sound-{index:03d}.mp4")) as container:
            assert len(container.streams.video) == 1 and len(container.streams.audio) == 1


def test_the_report_names_each_requests_mode(observed):
    modes = [row["mode"] for row in observed["one"]["outputs"]]
    assert modes == ["image-to-video, 5 frames", "video-to-video, 5 frames", "video-to-video, 5 frames"] + [
        "text-to-video, 5 frames"
    ]
    assert observed["image"]["mode"] == "image-to-video, 5 frames"


def test_the_conditioning_changes_the_latent_and_the_options_equal_a_json_line(observed):
    one = _digests(observed["one"])
    assert len(set(one)) == len(one)  # four requests, four latents: the image changed the first
    assert _digests(observed["image"]) == one[:1]  # --image and a JSON line's "image" alike


# --- every mode on the sound-capable ModelOpt fixture ---------------------------------------

SOUND_FIXTURE = Path(__file__).parents[1] / "fixtures" / "modelopt-0.47-cosmos3-sound-transformer"
# Ulysses included: 2 query heads, one a rank under SP 2, as on the text-only fixture (full_attention)
FIXTURE_LAYOUTS = ["fsdp", "cfg", "sp", "cfg sp"]
# mp4 input: diffusers' load_video reads it through imageio and imageio-ffmpeg (the media extra)
MP4_READABLE = all(importlib.util.find_spec(m) for m in ("imageio", "imageio_ffmpeg"))


def _write_mp4(path: Path, frames: list) -> None:
    """Frames into an mp4 by a real encoder (PyAV's libx264rgb at qp 0: lossless, so the mp4's
    frames are the pictures themselves)."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264rgb", rate=24, options={"qp": "0", "preset": "ultrafast"})
        stream.width, stream.height, stream.pix_fmt = frames[0].width, frames[0].height, "rgb24"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_image(frame)))
        container.mux(stream.encode())


def _sound_fixture_inputs(root: Path) -> None:
    """clip.mp4: the frames of clip/ as an mp4; the sound fixture's requests: image, the clip as
    a directory and (where imageio reads mp4s) as that mp4, both with one seed."""
    _write_mp4(root / "clip.mp4", [_picture(10 + i) for i in range(5)])
    lines = [
        {"prompt": "a red fox", "image": "still.png"},
        {"prompt": "a lighthouse", "video": "clip", "seed": 3},
        *([{"prompt": "a lighthouse", "video": "clip.mp4", "seed": 3}] if MP4_READABLE else []),
    ]
    (root / "fixture-modes.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.fixture(scope="module")
def sound_fixture_root(tmp_path_factory, demo_root) -> str:
    """The sound-capable ModelOpt 0.47 export beside the demo's VAE and sound tokenizer."""
    from pipelines import pipeline_beside_the_demo

    return pipeline_beside_the_demo(demo_root, tmp_path_factory.mktemp("sound-fixture") / "root", SOUND_FIXTURE)


def _on_the_sound_fixture(root: str, inputs: str, reports: Path, name: str, extra: tuple, rank: int = 0) -> dict:
    """Two launcher runs on the sound fixture: image, video (directory and mp4); sound, image + sound."""
    modes = ("--prompts", str(Path(inputs, "fixture-modes.jsonl")))
    sound = ("--sound", "--prompts", str(Path(inputs, "sound.jsonl")))
    return {
        f"{name} sound fixture": _launch(root, Path(f"{reports}-sound-fixture.json"), *modes, *extra, rank=rank),
        f"{name} sound fixture sound": _launch(
            root, Path(f"{reports}-sound-fixture-sound.json"), *sound, *extra, rank=rank
        ),
    }


@pytest.mark.parametrize("layout", FIXTURE_LAYOUTS)
def test_image_and_video_on_the_sound_fixture_give_the_one_rank_latent_on_every_layout(observed, layout):
    one = observed["one sound fixture"]
    assert [row["mode"] for row in one["outputs"][:2]] == ["image-to-video, 5 frames", "video-to-video, 5 frames"]
    assert _digests(one)[0] != _digests(one)[1]
    assert _digests(observed["ranks"][f"{layout} sound fixture"]) == _digests(one)


@pytest.mark.parametrize("layout", FIXTURE_LAYOUTS)
def test_sound_and_image_with_sound_on_the_sound_fixture_give_the_one_rank_latent_and_track(observed, layout):
    one, ranks = observed["one sound fixture sound"], observed["ranks"][f"{layout} sound fixture sound"]
    assert [row["mode"] for row in one["outputs"]] == [
        "text-to-video, 5 frames, sound",
        "image-to-video, 5 frames, sound",
    ]
    assert all(_sounds(one)) and len(set(_sounds(one))) == 2 and len(set(_digests(one))) == 2
    assert _digests(ranks) == _digests(one) and _sounds(ranks) == _sounds(one)


@pytest.mark.skipif(not MP4_READABLE, reason="imageio / imageio-ffmpeg not installed (the media extra)")
def test_an_mp4_video_gives_the_latent_of_its_frames_as_a_directory(observed):
    rows = observed["one sound fixture"]["outputs"]
    assert rows[2]["mode"] == "video-to-video, 5 frames"
    assert rows[2]["latent_sha256"] == rows[1]["latent_sha256"] != rows[0]["latent_sha256"]


def test_the_sound_fixture_loads_its_audio_projection_as_fp8_outside_both_towers(capsys):
    import torch

    from fsdp_fp8 import load_model
    from fsdp_fp8.cli import commands

    loaded = load_model(None, SOUND_FIXTURE, device=torch.device("cpu"))
    config = json.loads((SOUND_FIXTURE / "config.json").read_text())
    assert config["sound_gen"] and "audio_proj_out" in config["quantization_config"]["ignore"]
    # audio_proj_in embeds the sound latents, as proj_in the vision patches: neither tower's
    assert "audio_proj_in" in loaded.fp8_linears and "audio_proj_out" not in loaded.fp8_linears
    assert loaded.towers["audio_proj_in"] == loaded.towers["proj_in"] == "other"
    towers = [loaded.towers[name] for name in loaded.fp8_linears]
    assert towers.count("reasoner") == towers.count("generation") > 0
    assert commands.main(["inspect", str(SOUND_FIXTURE), "--world-size", "2"]) == 0
    assert "ignore list:     audio_proj_out, embed_tokens, lm_head, proj_out" in capsys.readouterr().out


# --- refusals before the load --------------------------------------------------------------


def _refusal(capsys, *argv: str) -> str:
    from fsdp_fp8.cli.arguments import parse_run_args

    with pytest.raises(SystemExit) as exit_info:
        parse_run_args(list(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    return err


def test_careless_images_are_refused_naming_the_file(tmp_path, capsys):
    from PIL import Image

    text = tmp_path / "notes.png"
    text.write_text("not an image")
    Image.new("RGB", (4, 4)).save(tmp_path / "anim.gif")
    Image.new("1", (8200, 8200)).save(tmp_path / "huge.png")  # 67.2 MP, a few KB on disk
    cases = {
        str(tmp_path / "missing.png"): "missing.png: no such file",
        str(tmp_path): "is a directory; name an image file",
        str(text): "notes.png is not an image (PNG, JPEG, WEBP)",
        str(tmp_path / "anim.gif"): "anim.gif is a GIF image; it takes PNG, JPEG, WEBP",
        str(tmp_path / "huge.png"): "is 8200 x 8200 = 67,240,000 pixels; an input image is at most 67,108,864",
    }
    for path, needle in cases.items():
        assert needle in _refusal(capsys, "--image", path), path


def test_careless_videos_are_refused(tmp_path, capsys):
    from PIL import Image

    (tmp_path / "empty").mkdir()
    many = tmp_path / "many"
    many.mkdir()
    for i in range(1025):
        Image.new("RGB", (1, 1)).save(many / f"{i:04d}.png")
    (tmp_path / "clip.txt").write_text("x")
    assert "empty has no frames" in _refusal(capsys, "--video", str(tmp_path / "empty"))
    assert "has 1,025 frames; a conditioning video is at most 1,024" in _refusal(capsys, "--video", str(many))
    assert "give an mp4, an animated GIF or PNG" in _refusal(capsys, "--video", str(tmp_path / "clip.txt"))
    assert "no such file or directory" in _refusal(capsys, "--video", str(tmp_path / "gone.mp4"))


@pytest.mark.parametrize("missing", ["imageio", "imageio_ffmpeg"])
def test_an_mp4_without_imageio_or_its_ffmpeg_names_both_and_the_extra(inputs, capsys, missing):
    import sys

    with mock.patch.dict(sys.modules, {missing: None}):  # as on a machine without it: import fails
        err = _refusal(capsys, "--video", str(inputs / "clip.mp4"))
    assert "clip.mp4: reading .mp4 needs imageio and imageio-ffmpeg" in err and "fsdp-fp8[media]" in err


@pytest.mark.skipif(not MP4_READABLE, reason="imageio / imageio-ffmpeg not installed (the media extra)")
def test_an_mp4_whose_frames_are_over_the_pixel_bound_is_refused(inputs, capsys):
    from fsdp_fp8.generation import media

    with mock.patch.object(media, "MAX_IMAGE_PIXELS", 48 * 40 - 1):  # the clip's frames: 48 x 40
        err = _refusal(capsys, "--video", str(inputs / "clip.mp4"))
    assert "clip.mp4: its frames are 48 x 40 = 1,920 pixels; an input image is at most 1,919" in err


def test_sound_is_refused_for_a_png_or_a_pipeline_without_a_sound_tokenizer(demo_root, tmp_path, capsys):
    import shutil

    assert "--sound is muxed into a video file; --output" in _refusal(
        capsys, "--sound", "--output", str(tmp_path / "out.png")
    )
    silent = tmp_path / "silent"
    shutil.copytree(demo_root, silent)
    index = json.loads((silent / "model_index.json").read_text())
    (silent / "model_index.json").write_text(json.dumps({**index, "sound_tokenizer": [None, None]}))
    err = _refusal(capsys, "--checkpoint", str(silent), "--sound")
    assert "names no `sound_tokenizer` ([None, None]); this pipeline has no sound" in err


def test_combinations_that_cannot_work_are_refused(inputs, tmp_path, capsys):
    image, clip = str(inputs / "still.png"), str(inputs / "clip")
    assert "an image and a video; the pipeline takes one" in _refusal(capsys, "--image", image, "--video", clip)
    assert "give a --video too" in _refusal(capsys, "--condition-keep", "last")
    assert "--frames 1 makes an image" in _refusal(capsys, "--image", image, "--frames", "1")
    lines = tmp_path / "bad.jsonl"
    lines.write_text('{"prompt": "a", "colour": "red"}\n{"prompt": "b", "image": "nothing.png"}\n')
    err = _refusal(capsys, "--prompts", str(lines))
    assert "line 1: unknown key 'colour'" in err
    assert "the demo makes one image unless told otherwise: pass --frames 5" in _refusal(
        capsys, "--prompts", str(inputs / "requests.jsonl")
    )
    lines.write_text('{"prompt": "b", "image": "nothing.png"}\n')
    assert f'--prompts {lines} line 1 "image" {tmp_path / "nothing.png"}: no such file' in _refusal(
        capsys, "--prompts", str(lines)
    )
