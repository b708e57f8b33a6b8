"""The config's arithmetic (``fsdp_fp8.runtime.vae_arithmetic``) against diffusers' own
``AutoencoderKLWan`` traced on fake tensors (``fsdp_fp8.runtime.vae_trace``), every op traced:
byte for byte equal (the issue's bar is 1%), for the demo's VAE and a Wan 2.2-shaped one, the
decode untiled and tiled and the encode, at tiny sizes: odd heights and widths, edge tiles, frames
past the trace's ``SIMULATED`` and past where the joined output starts to set the peak (the
trace's line is low there; the arithmetic is not). The replayed trace the fallback uses gives the
same peaks as tracing every op; and a config with a key the arithmetic does not read is traced."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers")
pytestmark = pytest.mark.timeout(900)

from pipelines import DEMO_TILES, WAN22_CONFIG, WAN22_TILES

from fsdp_fp8.runtime import vae_arithmetic, vae_forecast, vae_trace

BF16 = torch.bfloat16
# (phase, shape, dtype) per VAE; a decode's shape is its latent (frames, height, width), an
# encode's its video's. Tiles: 4 latent rows / columns every 3 for both VAEs.
GRID = {
    "demo": (
        ("decode", (1, 2, 3), None),
        ("decode", (2, 3, 5), None),
        ("decode", (8, 5, 3), BF16),
        ("decode", (20, 2, 3), None),  # the joined output sets the peak from ~18 frames on
        ("tiled", (2, 5, 6), None),
        ("tiled", (3, 4, 5), None),
        ("tiled", (7, 7, 5), BF16),
        ("tiled", (8, 5, 4), None),
        ("encode", (1, 8, 8), None),
        ("encode", (9, 12, 20), None),
        ("encode", (13, 9, 7), None),
        ("encode", (25, 12, 16), BF16),
    ),
    "wan22": (
        ("decode", (1, 1, 1), None),
        ("decode", (2, 2, 3), None),
        ("decode", (7, 3, 1), BF16),
        ("decode", (12, 2, 3), None),  # past ~10 frames: the joined output
        ("tiled", (2, 5, 6), None),
        ("tiled", (3, 7, 4), BF16),
        ("tiled", (7, 5, 5), None),
        ("tiled", (8, 4, 7), None),
        ("encode", (1, 16, 16), None),
        ("encode", (5, 32, 48), None),
        ("encode", (13, 16, 32), BF16),
        ("encode", (25, 16, 16), None),
    ),
}


def _config(name: str, demo_root) -> tuple[dict, tuple]:
    if name == "demo":
        return json.loads((demo_root / "vae" / "config.json").read_text()), DEMO_TILES
    return dict(WAN22_CONFIG), WAN22_TILES


def _figures(config, tiles, phase, size, dtype, replay):
    """(arithmetic, trace) for one case."""
    dtype = dtype or torch.float32
    if phase == "encode":
        shape = (1, 3, *size)
        run = lambda vae, x: vae.encode(x)
        arithmetic = vae_arithmetic.encode_bytes(config, shape, dtype)
        tiles = None
    else:
        shape = (1, config["z_dim"], *size)
        run = lambda vae, z: vae.decode(z)
        tiles = tiles if phase == "tiled" else None
        arithmetic = vae_arithmetic.decode_bytes(config, shape, dtype, tiles)
    return arithmetic, vae_trace._simulate(config, dtype, tiles, run, shape, replay=replay)


@pytest.mark.parametrize("name", ["demo", "wan22"])
def test_arithmetic_equals_every_op_traced(demo_root, name):
    config, tiles = _config(name, demo_root)
    assert not vae_arithmetic.unmodelled(config, torch.float32)
    figures = {case: _figures(config, tiles, *case, replay=False) for case in GRID[name]}
    off = {case: f"{a / t - 1:+.4%}" for case, (a, t) in figures.items() if a != t}
    assert not off, (off, figures)


@pytest.mark.parametrize("name", ["demo", "wan22"])
def test_the_replayed_trace_equals_every_op_traced(demo_root, name):
    """The fallback's trace replays repeated encoder / decoder calls and tile blends: the same
    peak, byte for byte, untiled and tiled (here against the arithmetic, which the test above
    holds equal to every op traced)."""
    config, tiles = _config(name, demo_root)
    figures = {case: _figures(config, tiles, *case, replay=True) for case in GRID[name]}
    off = {case: (a, t) for case, (a, t) in figures.items() if a != t}
    assert not off, off


def test_a_config_the_arithmetic_does_not_read_is_traced(demo_root, caplog):
    config, _ = _config("demo", demo_root)
    assert vae_forecast.forecast_method(config, torch.float32) == vae_forecast.ARITHMETIC
    unknown = dict(config, new_option=1)
    assert vae_arithmetic.unmodelled(unknown, torch.float32) == ["`new_option`: not modelled"]
    for changed, why in (
        ({"attn_scales": [0.5]}, "`attn_scales` [0.5]: only [] is modelled"),
        ({"dropout": 0.1}, "`dropout` 0.1: only 0.0 is modelled"),
        ({"dim_mult": [1, 0, 1]}, "not modelled"),
    ):
        assert why in "; ".join(vae_arithmetic.unmodelled(dict(config, **changed), torch.float32))
    assert vae_arithmetic.unmodelled(config, torch.float8_e4m3fn) == ["dtype torch.float8_e4m3fn: not modelled"]
    latent = (1, config["z_dim"], 2, 3, 4)
    with caplog.at_level("WARNING"):
        traced = vae_forecast.decode_bytes(unknown, latent)
    assert "traced on fake tensors (`new_option`: not modelled)" in caplog.text
    assert traced == vae_trace.decode_bytes(config, latent) == vae_arithmetic.decode_bytes(config, latent)
