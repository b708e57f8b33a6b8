"""The VAE's phases in the forecast against measured peaks: the live tensor bytes on the CPU while
diffusers' ``AutoencoderKLWan`` really decodes (untiled and tiled) and encodes
(``fsdp_fp8.testing.live_bytes``, the same measure as tests/distributed/test_forecast.py's), at three sizes
per VAE: a short clip, one past the frames after which the arithmetic replays its calls, and one past
where the joined output sets the peak; and ``inspect`` on a pipeline
root printing the whole job phase by phase with its peak named and what gave the VAE's figures.
tests/unit/test_vae_arithmetic.py holds the arithmetic to the trace."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("diffusers")
pytestmark = pytest.mark.timeout(900)

from pipelines import DEMO_TILES, WAN22_CONFIG, WAN22_TILES  # noqa: E402

from fsdp_fp8.runtime.vae_arithmetic import WARM  # noqa: E402
from fsdp_fp8.runtime.vae_forecast import ARITHMETIC, decode_bytes, encode_bytes  # noqa: E402

TOLERANCE = 0.15
# (latent frames, latent height, width) per VAE: a short clip, one past WARM frames, one past where
# the joined output sets the peak (~18 latent frames for the demo's VAE, ~10 for the Wan 2.2 one).
SIZES = {"demo": ((2, 8, 8), (WARM + 6, 6, 10), (24, 2, 3)), "wan22": ((2, 4, 6), (WARM + 6, 3, 5), (14, 2, 3))}


def _vae(name: str, demo_root):
    from diffusers import AutoencoderKLWan

    if name == "demo":
        return AutoencoderKLWan.from_pretrained(demo_root / "vae").eval(), DEMO_TILES
    torch.manual_seed(0)
    return AutoencoderKLWan(**WAN22_CONFIG).eval(), WAN22_TILES


def _measured(vae, run, x) -> int:
    from fsdp_fp8.testing.live_bytes import LiveBytes, module_tensors

    with torch.no_grad(), LiveBytes("cpu", module_tensors(vae)) as live:
        run(x)
    return live.peak - live.baseline


@pytest.mark.parametrize("name", ["demo", "wan22"])
def test_forecast_is_within_15_percent_of_the_measured_peaks_at_three_sizes(demo_root, name):
    vae, tiles = _vae(name, demo_root)
    config, ratio, temporal = dict(vae.config), vae.config.scale_factor_spatial, vae.config.scale_factor_temporal
    errors = {}
    for frames, h, w in SIZES[name]:
        latent = (1, vae.config.z_dim, frames, h, w)
        z = torch.randn(latent, generator=torch.Generator().manual_seed(0))
        for label, tiling in (("untiled", None), ("tiled", tiles)):
            vae.use_tiling = tiling is not None
            if tiling:
                vae.enable_tiling(*tiling)
            errors[(frames, label)] = (decode_bytes(config, latent, tiles=tiling), _measured(vae, vae.decode, z))
        vae.use_tiling = False
        video = (1, 3, (frames - 1) * temporal + 1, h * ratio, w * ratio)
        x = torch.randn(video, generator=torch.Generator().manual_seed(1))
        errors[(frames, "encode")] = (encode_bytes(config, video), _measured(vae, vae.encode, x))
    off = {k: f / m - 1 for k, (f, m) in errors.items() if abs(f / m - 1) > TOLERANCE}
    assert not off, (off, errors)


def _wan22_root(demo_root, tmp_path):
    """The demo pipeline with a Wan 2.2-shaped VAE (random weights) in place of its own."""
    from diffusers import AutoencoderKLWan

    root = tmp_path / "wan22-root"
    shutil.copytree(demo_root, root, ignore=shutil.ignore_patterns("vae"))
    torch.manual_seed(0)
    AutoencoderKLWan(**WAN22_CONFIG).save_pretrained(root / "vae")
    return root


@pytest.mark.parametrize("name", ["demo", "wan22"])
def test_inspect_prints_the_whole_job_with_its_peak_named(demo_root, tmp_path, capsys, name):
    from fsdp_fp8.cli.commands import main

    root = demo_root if name == "demo" else _wan22_root(demo_root, tmp_path)
    assert main(["inspect", str(root), "--world-size", "2", "--height", "64", "--width", "96", "--frames", "5"]) == 0
    out = capsys.readouterr().out
    job = out[out.index("whole job per GPU") :].splitlines()
    names = [line[2:36].strip() for line in job[1:]]
    assert names[:4] == [
        "denoising loop",
        "VAE decode, untiled",
        "VAE decode, tiled",
        "VAE encode, conditioning video",
    ], job
    config = json.loads((root / "vae" / "config.json").read_text())
    spatial = config["scale_factor_spatial"]
    assert f"latent (1, {config['z_dim']}, 2, {64 // spatial}, {96 // spatial})" in job[2]
    peaks = [line for line in job if "peak, --vae-tiling" in line]
    assert len(peaks) == 2 and all("(set by: " in line for line in peaks), job
    assert job[7] == f"  VAE figures: {ARITHMETIC}", job
