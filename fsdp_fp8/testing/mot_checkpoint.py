"""A small deterministic FP8 checkpoint of the reference MoT (diffusers-free), for tests and checks.

The embedded demo is a Cosmos 3 pipeline (``fsdp_fp8.generation.demo``); where a check needs a model
without diffusers (the GPU checks, the reference-model path of the launcher), this writes
the reference MoT's ``demo`` preset: random seeded weights, calibrated on its own sampler,
exported with the published first/last-3 step policy.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fsdp_fp8.export.modelopt import export_fp8
from fsdp_fp8.format.step_policy import PUBLISHED_POLICY
from fsdp_fp8.models import PRESETS, ReferenceMoTTransformer, build_model, init_weights
from fsdp_fp8.runtime.sampler import sample

MOT_PRESET = "demo"
MOT_SEED = 0
MOT_PROMPT_TOKENS = 16
MOT_LATENT_TOKENS = 64
MOT_CALIBRATION_STEPS = 8
MOT_MAX_SHARD_SIZE = 3_000_000  # bytes: the ~7.5 MB model lands in a few shards


def mot_prompt_ids(batch: int = 1) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(MOT_SEED + 1)
    return torch.randint(0, PRESETS[MOT_PRESET].vocab_size, (batch, MOT_PROMPT_TOKENS), generator=gen)


def mot_model() -> ReferenceMoTTransformer:
    """The high-precision (BF16) model the checkpoint is quantized from."""
    return init_weights(build_model(PRESETS[MOT_PRESET], device="cpu"), seed=MOT_SEED)


def write_mot_checkpoint(directory: str | os.PathLike) -> Path:
    """Write the checkpoint into the empty or missing ``directory``."""
    model = mot_model()

    def calibrate(m: ReferenceMoTTransformer) -> None:
        sample(m, mot_prompt_ids(), steps=MOT_CALIBRATION_STEPS, seed=MOT_SEED, num_latent_tokens=MOT_LATENT_TOKENS)

    return export_fp8(
        model,
        Path(directory),
        config=model.config.to_config_dict(),
        calibrate=calibrate,
        step_policy=PUBLISHED_POLICY,
        max_shard_size=MOT_MAX_SHARD_SIZE,
    )
