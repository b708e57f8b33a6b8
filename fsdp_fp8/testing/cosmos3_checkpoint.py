"""A random-weight diffusers Cosmos 3 transformer of any size, exported to ModelOpt static FP8.

The demo pipeline (``fsdp_fp8.generation.demo``) fixes one small transformer; the Ulysses
tests and bench need others: heads that a group of 4 can share, a long generation sequence.
This builds ``Cosmos3OmniTransformer(**config)`` from a seed (BF16, its time embedder in
float32 as diffusers keeps it), calibrates its input scales on a few seeded forwards of the
real model (``interop.cosmos.pack_inputs``) and writes it with ``export_fp8``. Needs diffusers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from fsdp_fp8.export.modelopt import DEFAULT_IGNORE, export_fp8
from fsdp_fp8.interop.cosmos import SOUND_PROJECTIONS, latent_shape, pack_inputs

CALIBRATION_TIMESTEPS = (900.0, 500.0, 100.0)


def cosmos3_transformer(config: Mapping, seed: int = 0):
    """The high-precision transformer the checkpoint is quantized from."""
    from diffusers import Cosmos3OmniTransformer

    torch.manual_seed(seed)
    model = Cosmos3OmniTransformer(**config).to(torch.bfloat16).eval()
    model.time_embedder.float()  # _keep_in_fp32_modules
    return model


@torch.no_grad()
def write_cosmos3_checkpoint(
    directory: str | os.PathLike,
    config: Mapping,
    *,
    seed: int = 0,
    latent: tuple[int, int, int] = (1, 8, 8),
    text_tokens: int = 6,
) -> Path:
    """Write the FP8 checkpoint into the empty or missing ``directory``; calibrated on seeded
    forwards at a ``latent`` of (frames, height, width) and ``text_tokens`` prompt tokens."""
    model = cosmos3_transformer(config, seed)

    def calibrate(m) -> None:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, m.config.vocab_size, (text_tokens,), generator=g)
        for timestep in CALIBRATION_TIMESTEPS:
            x = torch.randn(latent_shape(m.config, *latent), generator=g).to(torch.bfloat16)
            m(**pack_inputs(m.config, ids, x, timestep))

    config = json.loads(model.to_json_string())
    ignore = (*DEFAULT_IGNORE, *SOUND_PROJECTIONS)  # calibrated on vision alone
    return export_fp8(model, Path(directory), config=config, calibrate=calibrate, ignore=ignore)
