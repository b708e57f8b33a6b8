"""Flow-matching Euler sampler with classifier-free guidance, for the reference MoT model."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from fsdp_fp8.errors import ArgumentError

StepContext = Callable[[int, int], AbstractContextManager]


@torch.no_grad()
def sample(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    *,
    steps: int,
    seed: int,
    guidance: float = 3.0,
    num_latent_tokens: int,
    step_context: StepContext | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> torch.Tensor:
    """Integrate dx/dt = v from t=1 (noise) to t=0 in ``steps`` Euler steps; returns [B, N, C].

    ``step_context(i, steps)`` wraps both guidance passes of step ``i``, so anything it
    switches (a per-step precision policy) is the same for the conditional and the
    unconditional pass. The reasoner runs once, outside every step.
    """
    if steps < 1:
        raise ArgumentError(f"`steps` must be >= 1, got {steps}")
    if prompt_ids.dim() != 2:
        shape = tuple(prompt_ids.shape)
        raise ArgumentError(f"`prompt_ids` must be [batch, tokens], got shape {shape}")
    device, dtype = model.device, model.dtype
    batch = prompt_ids.shape[0]
    # Noise from a CPU generator: the same seed gives the same latents on every device/rank.
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = (batch, num_latent_tokens, model.config.latent_channels)
    x = torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    state = model.reason(prompt_ids.to(device))
    schedule = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float32)
    for i in range(steps):
        t, t_next = schedule[i].item(), schedule[i + 1].item()
        timestep = torch.full((batch,), t, dtype=torch.float32, device=device)
        ctx = step_context(i, steps) if step_context is not None else contextlib.nullcontext()
        with ctx:
            v_cond = model.denoise(x, timestep, state)
            v_uncond = model.denoise(x, timestep, None)
        v = v_uncond + guidance * (v_cond - v_uncond)
        x = x + (t_next - t) * v
        if on_step is not None:
            on_step(i, steps)
    return x
