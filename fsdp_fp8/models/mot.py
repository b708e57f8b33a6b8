"""A Cosmos3-shaped mixture-of-transformers (MoT) diffusion denoiser, small and readable.

Each layer holds two towers with their own weights. The *reasoner* tower runs causal
self-attention over the prompt once per request and leaves its K/V per layer. The
*generation* tower denoises latent tokens, attending (non-causally) to that layer's reasoner
K/V followed by its own. Every projection is a plain ``nn.Linear`` called as ``module(x)``,
so an FP8 swap by module name takes effect without touching this file.

FSDP2 contract: ``fully_shard`` wraps each ``layers[i]`` and then the root; its hooks run on
``__call__``, so :meth:`reason`, :meth:`denoise` and :meth:`logits` all enter through
``self(...)`` and each layer is called as ``layer(...)``, never through a helper method.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_fp8.errors import ArgumentError
from fsdp_fp8.models.mot_config import MoTConfig
from fsdp_fp8.models.ops import (
    TIME_FREQ_DIM,
    RMSNorm,
    RotaryEmbedding,
    SwiGLUMLP,
    TimestepEmbedding,
    apply_rope,
    timestep_features,
)

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ReasonerState:
    """What the generation tower needs from one reasoner pass."""

    kv: tuple[KV, ...]  # per layer: (k, v), each [B, heads, T, head_dim], RoPE applied
    hidden: torch.Tensor  # [B, T, hidden], after the final ``norm``

    @property
    def prompt_len(self) -> int:
        return self.hidden.shape[1]


class MoTAttention(nn.Module):
    def __init__(self, cfg: MoTConfig):
        super().__init__()
        inner = cfg.num_heads * cfg.head_dim
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        # Reasoner: LLM-style projections, no bias.
        self.to_q = nn.Linear(cfg.hidden_size, inner, bias=False)
        self.to_k = nn.Linear(cfg.hidden_size, inner, bias=False)
        self.to_v = nn.Linear(cfg.hidden_size, inner, bias=False)
        self.to_out = nn.Linear(inner, cfg.hidden_size, bias=False)
        # Generation: diffusers-style "added" projections, with bias (never quantized).
        self.add_q_proj = nn.Linear(cfg.hidden_size, inner)
        self.add_k_proj = nn.Linear(cfg.hidden_size, inner)
        self.add_v_proj = nn.Linear(cfg.hidden_size, inner)
        self.to_add_out = nn.Linear(inner, cfg.hidden_size)
        self.norm_q = RMSNorm(cfg.head_dim, cfg.rms_eps)
        self.norm_k = RMSNorm(cfg.head_dim, cfg.rms_eps)
        self.norm_added_q = RMSNorm(cfg.head_dim, cfg.rms_eps)
        self.norm_added_k = RMSNorm(cfg.head_dim, cfg.rms_eps)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.num_heads, self.head_dim))

    def _qkv(self, x, rope, q_proj, k_proj, v_proj, q_norm, k_norm):
        cos, sin = rope
        q = apply_rope(q_norm(self._heads(q_proj(x))), cos, sin).transpose(1, 2)
        k = apply_rope(k_norm(self._heads(k_proj(x))), cos, sin).transpose(1, 2)
        v = self._heads(v_proj(x)).transpose(1, 2)
        return q, k, v

    def forward(self, x, rope, kv: KV | None = None, *, phase: str):
        if phase == "reason":
            q, k, v = self._qkv(x, rope, self.to_q, self.to_k, self.to_v, self.norm_q, self.norm_k)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.to_out(out.transpose(1, 2).flatten(2)), (k, v)
        q, k, v = self._qkv(
            x,
            rope,
            self.add_q_proj,
            self.add_k_proj,
            self.add_v_proj,
            self.norm_added_q,
            self.norm_added_k,
        )
        if kv is not None:
            k, v = torch.cat([kv[0], k], dim=2), torch.cat([kv[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_add_out(out.transpose(1, 2).flatten(2))


class MoTLayer(nn.Module):
    def __init__(self, cfg: MoTConfig):
        super().__init__()
        self.self_attn = MoTAttention(cfg)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp_moe_gen = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm_moe_gen = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.post_attention_layernorm_moe_gen = RMSNorm(cfg.hidden_size, cfg.rms_eps)

    def forward(self, h, rope, kv: KV | None = None, *, phase: str):
        if phase == "reason":
            attn, new_kv = self.self_attn(self.input_layernorm(h), rope, phase="reason")
            h = h + attn
            return h + self.mlp(self.post_attention_layernorm(h)), new_kv
        if phase != "generate":
            raise ArgumentError(f"unknown phase {phase!r}; expected 'reason' or 'generate'")
        h = h + self.self_attn(self.input_layernorm_moe_gen(h), rope, kv, phase="generate")
        return h + self.mlp_moe_gen(self.post_attention_layernorm_moe_gen(h))


class ReferenceMoTTransformer(nn.Module):
    def __init__(self, config: MoTConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.proj_in = nn.Linear(config.latent_channels, h)
        self.time_embedder = TimestepEmbedding(TIME_FREQ_DIM, h)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.layers = nn.ModuleList(MoTLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(h, config.rms_eps)
        self.norm_moe_gen = RMSNorm(h, config.rms_eps)
        self.proj_out = nn.Linear(h, config.latent_channels)
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm_moe_gen.weight.dtype  # a norm is never swapped for FP8

    @property
    def device(self) -> torch.device:
        return self.norm_moe_gen.weight.device

    def reason(self, prompt_ids: torch.Tensor) -> ReasonerState:
        return self(prompt_ids, phase="reason")

    def denoise(self, latents: torch.Tensor, timestep: torch.Tensor, state: ReasonerState | None) -> torch.Tensor:
        return self(latents, timestep, state, phase="denoise")

    def logits(self, state: ReasonerState) -> torch.Tensor:
        return self(state, phase="logits")

    def forward(self, *args, phase: str = "denoise"):
        if phase == "reason":
            return self._reason(*args)
        if phase == "denoise":
            return self._denoise(*args)
        if phase == "logits":
            return self.lm_head(args[0].hidden)
        raise ArgumentError(f"unknown phase {phase!r}; expected 'reason', 'denoise' or 'logits'")

    def _rope(self, start: int, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb(torch.arange(start, start + length, device=device))

    def _reason(self, prompt_ids: torch.Tensor) -> ReasonerState:
        h = self.embed_tokens(prompt_ids)
        rope = self._rope(0, prompt_ids.shape[1], h.device)
        kvs = []
        for layer in self.layers:
            h, kv = layer(h, rope, phase="reason")
            kvs.append(kv)
        return ReasonerState(kv=tuple(kvs), hidden=self.norm(h))

    def _denoise(self, latents, timestep, state: ReasonerState | None) -> torch.Tensor:
        dtype = self.dtype
        temb = self.time_embedder(timestep_features(timestep).to(dtype))
        h = self.proj_in(latents.to(dtype)) + temb[:, None, :]
        # Latent tokens sit after the prompt; RoPE is relative, so without a prompt the
        # generation tokens see each other exactly as they do with one.
        start = state.prompt_len if state is not None else 0
        rope = self._rope(start, latents.shape[1], h.device)
        for i, layer in enumerate(self.layers):
            kv = state.kv[i] if state is not None else None
            h = layer(h, rope, kv, phase="generate")
        return self.proj_out(self.norm_moe_gen(h))


_REASONER = re.compile(r"layers\.\d+\.(self_attn\.(to_q|to_k|to_v|to_out)|mlp\.\w+_proj)")
_GENERATION = re.compile(
    r"layers\.\d+\.(self_attn\.(add_q_proj|add_k_proj|add_v_proj|to_add_out)|mlp_moe_gen\.\w+_proj)"
)
_OTHER = frozenset(("proj_in", "proj_out", "time_embedder.linear_1", "time_embedder.linear_2", "lm_head"))


def linear_towers(model: nn.Module) -> dict[str, str]:
    """Every linear of a MoT model (plain or swapped) by name -> 'reasoner'|'generation'|'other'.

    Names decide, not types, so the map is the same after an FP8 swap or ``fully_shard``.
    """
    towers: dict[str, str] = {}
    strays = []
    for name, module in model.named_modules():
        if _REASONER.fullmatch(name):
            towers[name] = "reasoner"
        elif _GENERATION.fullmatch(name):
            towers[name] = "generation"
        elif name in _OTHER:
            towers[name] = "other"
        elif isinstance(module, nn.Linear):
            strays.append(name)
    if strays:
        raise ArgumentError(f"linears with no known tower: {sorted(strays)}")
    return towers


def build_model(
    config: MoTConfig, device: str | torch.device = "meta", dtype: torch.dtype | None = None
) -> ReferenceMoTTransformer:
    """Build on ``device`` ("meta": no storage, for planning and sharded loading)."""
    # Parameters are created in ``dtype`` rather than cast afterwards: ``Module.to(dtype)``
    # would also round the float32 RoPE ``inv_freq`` buffer.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype or config.torch_dtype)
    try:
        with torch.device(device):
            return ReferenceMoTTransformer(config)
    finally:
        torch.set_default_dtype(previous)


@torch.no_grad()
def init_weights(model: ReferenceMoTTransformer, seed: int = 0) -> ReferenceMoTTransformer:
    """Seeded init, independent of construction order and device: activations stay O(1).

    Linears ~ N(0, 1/fan_in); residual-branch outputs are further scaled by
    1/sqrt(2 * layers) so the residual stream does not grow with depth; norms are 1,
    biases 0, embeddings N(0, 1).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    residual_out = (2 * model.config.num_layers) ** -0.5
    for name, p in sorted(model.named_parameters()):
        if re.search(r"norm\w*\.weight$", name):
            value = torch.ones(p.shape)
        elif name.endswith(".bias"):
            value = torch.zeros(p.shape)
        elif name == "embed_tokens.weight":
            value = torch.randn(p.shape, generator=gen)
        else:
            value = torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5
            if re.search(r"\.(to_out|to_add_out|down_proj)\.weight$", name):
                value *= residual_out
        p.copy_(value.to(p.dtype))
    return model
