"""diffusers ``Cosmos3OmniTransformer`` without its pipeline: packed inputs and a denoising loop.

The pipeline (``Cosmos3OmniPipeline``) packs one joint sequence per pass: the text
("understanding") prefix, then the vision ("generation") tokens, with 3-D mRoPE positions
from the pipeline's own helpers. :func:`pack_inputs` builds the same keyword arguments from
token ids and a latent, so a ``transformer/`` directory alone runs the real forward, and
:func:`denoise` runs a flow-matching Euler loop with classifier-free guidance over it (the
pipeline's UniPC solver and VAE are not needed for a digest). Needs diffusers (``fsdp_fp8[hf]``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from fsdp_fp8.errors import ArgumentError

StepContext = Callable[[int, int], AbstractContextManager]

# A sound-capable transformer's (``sound_gen``) projections of the audio tokens: a calibration on
# vision alone never runs them, so an FP8 export leaves them in high precision (ignored).
SOUND_PROJECTIONS = ("audio_proj_in", "audio_proj_out")


def pack_inputs(config, input_ids: torch.Tensor, latent: torch.Tensor, timestep: float) -> dict:
    """Forward kwargs for one pass: ``input_ids`` [T] text tokens, ``latent`` [1, C, F, H, W]."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import (
        get_3d_mrope_ids_text_tokens,
        get_3d_mrope_ids_vae_tokens,
    )

    und_len = int(input_ids.shape[0])
    p = config.latent_patch_size
    _, _, frames, height, width = latent.shape
    ph, pw = -(-height // p), -(-width // p)
    num_vision = frames * ph * pw
    text_pos, offset = get_3d_mrope_ids_text_tokens(und_len, 0, use_float_positions=config.enable_fps_modulation)
    vision_pos, _ = get_3d_mrope_ids_vae_tokens(
        frames,
        ph,
        pw,
        offset + config.unified_3d_mrope_temporal_modality_margin,
        reset_spatial_indices=config.unified_3d_mrope_reset_spatial_ids,
    )
    device = input_ids.device
    vision_index = torch.arange(und_len, und_len + num_vision, device=device)
    return {
        "input_ids": input_ids,
        "text_indexes": torch.arange(und_len, device=device),
        "position_ids": torch.cat([text_pos.to(vision_pos.dtype), vision_pos], dim=1).to(device),
        "und_len": und_len,
        "sequence_length": und_len + num_vision,
        "vision_tokens": [latent],
        "vision_token_shapes": [(frames, ph, pw)],
        "vision_sequence_indexes": vision_index,
        "vision_mse_loss_indexes": vision_index.clone(),
        "vision_timesteps": torch.full((num_vision,), float(timestep), device=device),
        "vision_noisy_frame_indexes": [torch.arange(frames, device=device)],
        "return_dict": False,
    }


def latent_shape(config, frames: int = 1, height: int = 4, width: int = 4) -> tuple[int, ...]:
    return (1, config.latent_channel, frames, height, width)


def seeded_inputs(config, dtype: torch.dtype, g: torch.Generator, text_tokens: int = 6) -> dict:
    """One pass on random token ids and a random latent (the launcher's one-forward recipe)."""
    ids = torch.randint(0, config.vocab_size, (text_tokens,), generator=g)
    latent = torch.randn(latent_shape(config), generator=g).to(dtype)
    return pack_inputs(config, ids, latent, timestep=500.0)


@torch.no_grad()
def denoise(
    model: nn.Module,
    cond_ids: torch.Tensor,
    uncond_ids: torch.Tensor | None,
    *,
    steps: int,
    seed: int,
    guidance: float,
    shape: tuple[int, ...],
    step_context: StepContext | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> torch.Tensor:
    """Integrate the predicted velocity from noise (sigma 1) to sigma 0 in ``steps`` Euler steps.

    Both guidance passes of step ``i`` run inside ``step_context(i, steps)``, as the pipeline
    runs them inside one loop iteration; ``uncond_ids=None`` (or ``guidance == 1``) runs one.
    Returns the float32 latent.
    """
    if steps < 1:
        raise ArgumentError(f"`steps` must be >= 1, got {steps}")
    param = next(p for p in model.parameters() if p.is_floating_point())
    device = param.device
    dtype = next(p.dtype for n, p in model.named_parameters() if n.startswith("layers."))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    sigmas = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float32)
    cfg = uncond_ids is not None and guidance != 1.0
    for i in range(steps):
        sigma, sigma_next = sigmas[i].item(), sigmas[i + 1].item()
        timestep = sigma * 1000.0
        latent = x.to(device=device, dtype=dtype)
        ctx = step_context(i, steps) if step_context is not None else contextlib.nullcontext()
        with ctx:
            v = model(**pack_inputs(model.config, cond_ids.to(device), latent, timestep))[0][0].float().cpu()
            if cfg:
                v_uncond = model(**pack_inputs(model.config, uncond_ids.to(device), latent, timestep))[0][0]
                v_uncond = v_uncond.float().cpu()
                v = v_uncond + guidance * (v - v_uncond)
        x = x + (sigma_next - sigma) * v
        if on_step is not None:
            on_step(i, steps)
    return x
