"""Small parameter-light building blocks of the reference models."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

TIME_FREQ_DIM = 256  # as diffusers' Timesteps(256) feeding TimestepEmbedding


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    # Two inputs, not one fused [gate; up] tensor: under static FP8 gate_proj and up_proj
    # keep their own weight_scale, so they stay two linears (docs/checkpoint-format.md, "The format, in brief").
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 statistics: a BF16 mean of squares loses the small rows.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE tables. ``inv_freq`` is derived from the config, so it is not in the checkpoint."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        # Explicitly on CPU so that a model built under ``torch.device("meta")`` still holds
        # real frequencies: nothing in a checkpoint could fill this buffer in later.
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim
        inv_freq = (1.0 / theta**exponent).to(torch.float32)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.to(positions.device)
        angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape [B, T, H, D] by tables of shape [T, D] (rotate-half convention)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (xf * cos + rotated * sin).to(x.dtype)


def timestep_features(timestep: torch.Tensor, dim: int = TIME_FREQ_DIM) -> torch.Tensor:
    """Sinusoidal features of flow-matching time ``t`` in [0, 1] (scaled to [0, 1000])."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half)
    args = timestep.to(torch.float32)[:, None] * 1000.0 * freqs[None, :]
    return torch.cat([args.cos(), args.sin()], dim=-1)


class TimestepEmbedding(nn.Module):
    def __init__(self, in_dim: int, hidden_size: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, hidden_size)
        self.linear_2 = nn.Linear(hidden_size, hidden_size)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(features)))


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
