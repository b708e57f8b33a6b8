"""The VAE's phases in the forecast against measured peaks: the live tensor bytes on the CPU while
diffusers' ``AutoencoderKLWan`` really decodes (untiled and tiled) and encodes
(``fsdp_fp8.testing.live_bytes``, the same measure as tests/distributed/test_forecast.py's), at two sizes per
VAE, one past ``SIMULATED`` latent frames (the forecast's per-frame line is then in use); and
``inspect`` on a pipeline root printing the whole job phase by phase with its peak named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("diffusers")
pytestmark = pytest.mark.timeout(900)

from pipelines import DEMO_TILES, WAN22_CONFIG, WAN22_TILES  # noqa: E402

from fsdp_fp8.runtime import vae_forecast  # noqa: E402
from fsdp_fp8.runtime.vae_forecast import SIMULATED, decode_bytes, encode_bytes  # noqa: E402

TOLERANCE = 0.15
# (latent frames, latent height, width) per VAE: a short clip, and one past SIMULATED frames.
SIZES = {"demo": ((2, 8, 8), (SIMULATED + 3, 6, 10)), "wan22": ((2, 4, 6), (SIMULATED + 3, 3, 5))}


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
def test_forecast_is_within_15_percent_of_the_measured_peaks_at_two_sizes(demo_root, name):
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


# (phase, shape) per VAE: with the tests' tiles, 3 x 3 tiles of 4 sizes (edge tiles: a last row
# and column), and frames past the causal cache's first states: repeated calls are replayed.
REPLAYED = {
    "demo": (("decode", (1, 4, 4, 7, 8)), ("encode", (1, 3, 9, 28, 32))),
    "wan22": (("decode", (1, 48, 4, 7, 8)), ("encode", (1, 3, 5, 112, 128))),
}


@pytest.mark.parametrize("name", ["demo", "wan22"])
def test_replayed_calls_give_the_peak_every_op_traced_gives(demo_root, name):
    """``inspect`` replays the VAE's repeated encoder / decoder calls and tile blends from their first
    trace (seconds instead of half a minute at 720p): the peak must be the one tracing every op gives,
    byte for byte, untiled and tiled, over calls replayed within one forecast and across forecasts."""
    vae, tiles = _vae(name, demo_root)
    config = dict(vae.config)

    def run(phase):
        return (lambda v, z: v.decode(z)) if phase == "decode" else (lambda v, x: v.encode(x))

    differ = {}
    for phase, shape in REPLAYED[name]:
        for tiling in (None, tiles):
            traced = vae_forecast._simulate(config, torch.float32, tiling, run(phase), shape, replay=False)
            replayed = vae_forecast._simulate(config, torch.float32, tiling, run(phase), shape)
            if replayed != traced:
                differ[(phase, shape, tiling)] = (replayed, traced)
    assert not differ, differ


def test_a_forecast_is_stored_once_and_read_back_by_the_next_process(demo_root, tmp_path, monkeypatch):
    """The store between processes: a figure computed once is read back without a trace; another
    key (tiles, shape) is computed; a store that is not JSON is recomputed and rewritten; off, no file."""
    config = json.loads((demo_root / "vae" / "config.json").read_text())
    monkeypatch.setenv("FSDP_FP8_CACHE", str(tmp_path))
    monkeypatch.delenv("FSDP_FP8_VAE_FORECAST_STORE")
    latent = (1, config["z_dim"], 3, 6, 8)
    first = decode_bytes(config, latent)
    store = tmp_path / vae_forecast.STORE_NAME
    assert store.is_file() and list(json.loads(store.read_text()).values()) == [first]

    def no_trace(*_args, **_kwargs):
        raise AssertionError("traced although the store holds the figure")

    with monkeypatch.context() as m:
        m.setattr(vae_forecast, "_simulate", no_trace)
        assert decode_bytes(config, latent) == first
        with pytest.raises(AssertionError, match="traced although"):
            decode_bytes(config, latent, tiles=(16, 16, 12, 12))  # another key: not in the store
    store.write_text("{not json")
    assert decode_bytes(config, latent) == first
    assert list(json.loads(store.read_text()).values()) == [first]
    monkeypatch.setenv("FSDP_FP8_VAE_FORECAST_STORE", "off")
    store.unlink()
    assert decode_bytes(config, latent) == first and not store.exists()
