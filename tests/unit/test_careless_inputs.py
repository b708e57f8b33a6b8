"""Careless inputs of a pipeline run refused before the load (issue 49): each a parse of the
command line (no load, no torch needed), one usage error naming the option, the file and both
values; and a conditioning file read at run time names itself when it fails."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from fsdp_fp8.cli.arguments import parse_run_args

MP4_READABLE = all(importlib.util.find_spec(m) for m in ("imageio", "imageio_ffmpeg"))
WAN = {"_class_name": "AutoencoderKLWan", "scale_factor_spatial": 16, "scale_factor_temporal": 4}


def _refusal(capsys, *argv: str) -> str:
    """The one error line of a usage error (exit 2)."""
    with pytest.raises(SystemExit) as exit_info:
        parse_run_args(list(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("error:") == 1, err
    return err.splitlines()[-1]


def _picture(path: Path, size=(48, 40), seed: int = 0) -> Path:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def _clip(directory: Path, frames: int = 5) -> Path:
    directory.mkdir()
    for i in range(frames):
        _picture(directory / f"{i:03d}.png", seed=i)
    return directory


def _truncated(path: Path, source: Path) -> Path:
    data = source.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _pipeline_root(root: Path, index: dict | None = None) -> Path:
    """A pipeline root as the parse step reads it: the index, the VAE's and the transformer's
    configs, a transformer checkpoint file; a folder for each component the index names."""
    index = index or {"_class_name": "Cosmos3OmniPipeline", "vae": ["diffusers", "AutoencoderKLWan"]}
    (root / "transformer").mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps({**index, "transformer": ["diffusers", "X"]}))
    for name, entry in index.items():
        if isinstance(entry, list) and entry[0] is not None:
            (root / name).mkdir(exist_ok=True)
    (root / "vae").mkdir(exist_ok=True)
    (root / "vae" / "config.json").write_text(json.dumps(WAN))
    (root / "transformer" / "config.json").write_text(json.dumps({"latent_patch_size": 2}))
    (root / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    return root


# --- --condition-frames against the latent timeline -------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--condition-frames", "0,7", "--frames", "5"], "--condition-frames 0,7: latent frame 7 is outside the "
         "latent timeline of --frames 5: 2 latent frames, 0..1 (1 + (5 - 1) // 4, `scale_factor_temporal` 4 in "
         "the demo's VAE)"),
        (["--condition-frames", "0,7"], "latent frame 7 is outside the latent timeline of the demo's 5 frames"),
        (["--condition-frames", "2,3,4", "--frames", "9"], "--condition-frames 2,3,4: latent frames [3, 4] are "
         "outside the latent timeline of --frames 9: 3 latent frames"),
        (["--condition-frames", "-1", "--frames", "5"], "--condition-frames -1: a latent frame index is >= 0, got -1"),
        (["--condition-frames", "", "--frames", "5"], "--condition-frames lists no latent frame index; give one"),
        (["--condition-frames", ",", "--frames", "5"], "--condition-frames lists no latent frame index; give one"),
    ],
)  # fmt: skip
def test_condition_frames_outside_the_latent_timeline_are_refused_before_the_load(tmp_path, capsys, argv, message):
    """They failed in diffusers after the whole load (exit 1); the frame count and the VAE's
    temporal factor are known before it."""
    err = _refusal(capsys, "--video", str(_clip(tmp_path / "clip")), *argv)
    assert message in err, err


def test_condition_frames_are_checked_against_the_pipelines_own_vae_config(tmp_path, capsys):
    root = _pipeline_root(tmp_path / "root")
    clip = _clip(tmp_path / "clip")
    err = _refusal(capsys, "--checkpoint", str(root), "--video", str(clip), "--frames", "9", "--condition-frames", "4")
    assert (
        f"--condition-frames 4: latent frame 4 is outside the latent timeline of --frames 9: 3 latent frames, 0..2 "
        f"(1 + (9 - 1) // 4, `scale_factor_temporal` 4 in {root / 'vae' / 'config.json'})"
    ) in err
    args = parse_run_args(["--checkpoint", str(root), "--video", str(clip), "--frames", "9", "--condition-frames", "2"])
    assert args.condition_frames == [2]  # the last latent frame is inside


def test_condition_frames_that_are_no_integers_say_frame_indexes(capsys):
    err = _refusal(capsys, "--condition-frames", "a,b")
    assert "expected comma-separated latent frame indexes (integers such as 0,1), got 'a,b'" in err
    assert "token ids" not in err


# --- the components model_index.json names ------------------------------------------------------


def test_a_component_folder_model_index_names_is_refused_when_missing(tmp_path, capsys):
    """A root naming `sound_tokenizer` with no such folder failed after the transformer's load with
    diffusers' "no file named config.json found in directory ROOT"."""
    index = {
        "_class_name": "Cosmos3OmniPipeline",
        "vae": ["diffusers", "AutoencoderKLWan"],
        "sound_tokenizer": ["diffusers", "Cosmos3AVAEAudioTokenizer"],
        "text_tokenizer": ["transformers", "TokenizersBackend"],
        "safety_checker": [None, None],
    }
    root = _pipeline_root(tmp_path / "root", index)
    (root / "sound_tokenizer").rmdir()
    (root / "text_tokenizer").rmdir()
    err = _refusal(capsys, "--checkpoint", str(root))
    for name in ("sound_tokenizer", "text_tokenizer"):
        assert f"model_index.json names the component `{name}`" in err, err
        assert f"its folder {root / name} does not exist" in err, err
    assert "diffusers.Cosmos3AVAEAudioTokenizer" in err and "safety_checker" not in err


def test_load_pipeline_refuses_a_missing_component_folder_before_the_transformer_loads(tmp_path, demo_root):
    """The Python API alike: refused before ``load_model`` (which is never called)."""
    from unittest import mock

    from fsdp_fp8.compose import pipeline as composer
    from fsdp_fp8.errors import ArgumentError

    root = tmp_path / "root"
    root.mkdir()
    for entry in Path(demo_root).iterdir():
        if entry.name != "sound_tokenizer":
            (root / entry.name).symlink_to(entry)
    with mock.patch.object(composer, "load_model", side_effect=AssertionError("loaded")):
        with pytest.raises(ArgumentError) as refused:
            composer.load_pipeline(root)
    assert "names the component `sound_tokenizer`" in str(refused.value)
    assert f"its folder {root / 'sound_tokenizer'} does not exist" in str(refused.value)


# --- images and videos decoded before the load, the file named ----------------------------------


def test_a_truncated_image_is_refused_before_the_load_naming_the_file(tmp_path, capsys):
    """A truncated PNG passed the header check and failed after the load (`error: image file is
    truncated`, the file not named); a JPEG alike; and a frame of a video directory."""
    png = _truncated(tmp_path / "cut.png", _picture(tmp_path / "whole.png", (640, 360)))
    from PIL import Image

    Image.open(tmp_path / "whole.png").convert("RGB").save(tmp_path / "whole.jpg")
    jpeg = _truncated(tmp_path / "cut.jpg", tmp_path / "whole.jpg")
    for path in (png, jpeg):
        err = _refusal(capsys, "--image", str(path), "--frames", "5")
        assert f"--image {path} cannot be decoded (truncated or corrupt)" in err, err
    clip = _clip(tmp_path / "clip")
    _truncated(clip / "002.png", _picture(tmp_path / "frame.png", (640, 360)))
    err = _refusal(capsys, "--video", str(clip), "--frames", "5")
    assert f"--video {clip / '002.png'} cannot be decoded (truncated or corrupt)" in err, err
    lines = tmp_path / "requests.jsonl"
    lines.write_text(json.dumps({"prompt": "a", "image": "cut.png"}) + "\n")
    err = _refusal(capsys, "--prompts", str(lines), "--frames", "5")
    assert f'--prompts {lines} line 1 "image" {png} cannot be decoded' in err, err


def test_whole_images_pass_and_only_a_budget_of_a_directorys_frames_is_decoded(tmp_path, monkeypatch):
    from fsdp_fp8.generation import media

    clip = _clip(tmp_path / "clip", frames=4)
    assert media.video_problems("--video", str(clip)) == []
    assert media.image_problems("--image", str(clip / "000.png")) == []
    decoded = []
    real = media._decode_problem
    monkeypatch.setattr(media, "_decode_problem", lambda o, p, whole: decoded.append(whole) or real(o, p, whole))
    monkeypatch.setattr(media, "MAX_DECODED_PIXELS", 48 * 40 // 2)  # a budget of two frames (x 4 / 2)
    assert media.video_problems("--video", str(clip)) == []
    assert decoded == [True, True, False, False]  # every frame verified, the first two decoded


def test_a_conditioning_file_that_fails_at_run_time_is_named(tmp_path):
    """A file changed after its check (or beyond what the check decodes) fails in diffusers'
    reader: the error names the file, in one line."""
    from fsdp_fp8.errors import ArgumentError
    from fsdp_fp8.generation.media import load_conditioning_image, load_conditioning_video

    png = _truncated(tmp_path / "cut.png", _picture(tmp_path / "whole.png", (640, 360)))
    with pytest.raises(ArgumentError, match=f"image {png} cannot be read: image file is truncated"):
        load_conditioning_image(str(png))
    clip = _clip(tmp_path / "clip", frames=2)
    _truncated(clip / "001.png", _picture(tmp_path / "frame.png", (640, 360)))
    with pytest.raises(ArgumentError, match=f"image {clip / '001.png'} cannot be read"):
        load_conditioning_video(str(clip))


@pytest.mark.skipif(not MP4_READABLE, reason="imageio / imageio-ffmpeg not installed (the media extra)")
def test_a_corrupt_mp4_is_one_error_line_without_ffmpegs_banner(tmp_path, capsys):
    """Its one `error:` line was followed by 15 lines of ffmpeg's banner and build configuration."""
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes())
    with pytest.raises(SystemExit):
        parse_run_args(["--video", str(clip), "--frames", "5"])
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]
    assert last.startswith("launch/infer.py: error: ") and f"--video {clip} cannot be read as a video" in last, err
    assert "ffmpeg version" not in err and "configuration:" not in err and "libavutil" not in err, err
    assert "(ffmpeg: " in last  # ffmpeg's verdict, its last line, kept in the one line
    from fsdp_fp8.errors import ArgumentError
    from fsdp_fp8.generation.media import load_conditioning_video

    with pytest.raises(ArgumentError) as failed:
        load_conditioning_video(str(clip))
    assert "ffmpeg version" not in str(failed.value) and str(clip) in str(failed.value)


# --- wording: what the thing is, and every problem of a file ------------------------------------


@pytest.mark.parametrize("option", ["--image", "--video", "--prompts", "--report"])
def test_a_symlink_loop_is_called_a_symlink_loop(tmp_path, capsys, option):
    """It was "not a regular file (a device, pipe or socket)" (and, for --prompts, "no such file")."""
    loop = tmp_path / "loop.png"
    loop.symlink_to(loop)
    err = _refusal(capsys, option, str(loop), "--frames", "5", "--overwrite")
    assert f"{option} {loop} is a symlink loop (a link that leads back to itself)" in err, err
    assert "device, pipe or socket" not in err and "no such file" not in err, err


@pytest.mark.parametrize("option", ["--image", "--video", "--prompts"])
def test_a_dangling_link_names_where_it_leads(tmp_path, capsys, option):
    link = tmp_path / "gone.png"
    link.symlink_to(tmp_path / "nowhere.png")
    err = _refusal(capsys, option, str(link), "--frames", "5")
    assert f"{option} {link} is a symbolic link to {tmp_path / 'nowhere.png'}, which does not exist" in err, err


def test_a_seed_that_is_no_integer_says_an_integer(tmp_path, capsys):
    """A float seed in a JSON line got "it takes a int"; on the command line argparse's
    "invalid int value"."""
    lines = tmp_path / "requests.jsonl"
    lines.write_text('{"prompt": "a", "seed": 1.5}\n{"prompt": "b", "negative_prompt": 4}\n')
    err = _refusal(capsys, "--prompts", str(lines))
    assert "line 1: 'seed' is 1.5; it takes an integer" in err and "a int" not in err, err
    assert "line 2: 'negative_prompt' is 4; it takes a string or null" in err, err
    err = _refusal(capsys, "--seed", "1.5")
    assert "argument --seed: expected an integer, got '1.5'" in err and "invalid int value" not in err, err


def test_a_prompts_file_with_several_bad_lines_lists_every_problem(tmp_path, capsys):
    """It showed the first and "(and 4 more)" where the docs promise every problem at once."""
    lines = tmp_path / "requests.jsonl"
    bad = [
        '{"prompt": "a", "seed": -1}',
        '{"prompt": "b", "colour": "red"}',
        "a plain line is fine",
        '{"prompt": 3}',
        '{"prompt": "c", "image": 7}',
        "{not json",
    ]
    lines.write_text("\n".join(bad) + "\n")
    err = _refusal(capsys, "--prompts", str(lines))
    for needle in (
        "line 1: 'seed' -1 is outside 0 .. 2**63 - 1",
        "line 2: unknown key 'colour'",
        'line 4: a JSON line is an object with a "prompt" string',
        "line 5: 'image' is 7; it takes a string",
        "line 6 is not a JSON object",
    ):
        assert f"--prompts {lines}: {needle}" in err, (needle, err)
    assert "more)" not in err and "line 3" not in err, err
