"""The reference MoT model: published names, tower membership, shapes on meta, semantics."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from fsdp_fp8.models import (
    PRESETS,
    MoTConfig,
    ReferenceMoTTransformer,
    build_model,
    init_weights,
    linear_towers,
)
from fsdp_fp8.models.ops import TIME_FREQ_DIM, swiglu

TINY32 = dataclasses.replace(PRESETS["tiny"], dtype="float32")
PER_LAYER_LINEARS = {
    "self_attn.to_q": "reasoner",
    "self_attn.to_k": "reasoner",
    "self_attn.to_v": "reasoner",
    "self_attn.to_out": "reasoner",
    "mlp.gate_proj": "reasoner",
    "mlp.up_proj": "reasoner",
    "mlp.down_proj": "reasoner",
    "self_attn.add_q_proj": "generation",
    "self_attn.add_k_proj": "generation",
    "self_attn.add_v_proj": "generation",
    "self_attn.to_add_out": "generation",
    "mlp_moe_gen.gate_proj": "generation",
    "mlp_moe_gen.up_proj": "generation",
    "mlp_moe_gen.down_proj": "generation",
}
PER_LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "input_layernorm_moe_gen",
    "post_attention_layernorm_moe_gen",
    "self_attn.norm_q",
    "self_attn.norm_k",
    "self_attn.norm_added_q",
    "self_attn.norm_added_k",
)
OTHER = ("proj_in", "proj_out", "time_embedder.linear_1", "time_embedder.linear_2", "lm_head")


def tiny(seed: int = 0, config: MoTConfig = TINY32) -> ReferenceMoTTransformer:
    return init_weights(build_model(config, device="cpu"), seed=seed)


def prompt(batch: int = 2, tokens: int = 7) -> torch.Tensor:
    return torch.randint(0, 100, (batch, tokens), generator=torch.Generator().manual_seed(3))


def latents(batch: int = 2, tokens: int = 5) -> torch.Tensor:
    return torch.randn(batch, tokens, 6, generator=torch.Generator().manual_seed(4))


def test_published_module_names_and_linear_towers():
    model = tiny()
    modules = dict(model.named_modules())
    expected = {name: tower for name, tower in zip(OTHER, ["other"] * 5)}
    for i in range(TINY32.num_layers):
        expected.update({f"layers.{i}.{n}": t for n, t in PER_LAYER_LINEARS.items()})
        for norm in PER_LAYER_NORMS:
            assert modules[f"layers.{i}.{norm}"].weight.dim() == 1
    assert linear_towers(model) == expected
    # Every nn.Linear of the model has a tower: none is left out of the map.
    assert {n for n, m in modules.items() if isinstance(m, nn.Linear)} == set(expected)
    for name in ("embed_tokens", "norm", "norm_moe_gen"):
        assert name in modules
    assert isinstance(model.layers, nn.ModuleList)


def _calls(model: nn.Module, names, fn) -> set[str]:
    called: set[str] = set()
    modules = dict(model.named_modules())
    handles = [modules[n].register_forward_hook(lambda _m, _a, _o, n=n: called.add(n)) for n in names]
    try:
        with torch.no_grad():
            fn()
    finally:
        for h in handles:
            h.remove()
    return called


def test_tower_membership_is_what_each_phase_calls():
    model = tiny()
    towers = linear_towers(model)
    of = lambda tower: {n for n, t in towers.items() if t == tower}  # noqa: E731
    state = model.reason(prompt())
    t = torch.full((2,), 0.5)
    assert _calls(model, towers, lambda: model.reason(prompt())) == of("reasoner")
    generation_calls = of("generation") | (of("other") - {"lm_head"})
    assert _calls(model, towers, lambda: model.denoise(latents(), t, state)) == generation_calls
    assert _calls(model, towers, lambda: model.denoise(latents(), t, None)) == generation_calls
    assert _calls(model, towers, lambda: model.logits(state)) == {"lm_head"}


def test_swapped_linears_are_called_and_mapped():
    """Another module put in a linear's place (as the FP8 swap does) is the one that runs."""

    class Swapped(nn.Module):
        def __init__(self, linear: nn.Linear):
            super().__init__()
            self.weight, self.bias, self.calls = linear.weight, linear.bias, 0

        def forward(self, x):
            self.calls += 1
            return torch.nn.functional.linear(x, self.weight, self.bias)

    model = tiny()
    reference = model.denoise(latents(), torch.full((2,), 0.3), model.reason(prompt()))
    towers_before = linear_towers(model)
    for name in towers_before:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, leaf, Swapped(getattr(owner, leaf)))
    assert linear_towers(model) == towers_before
    out = model.denoise(latents(), torch.full((2,), 0.3), model.reason(prompt()))
    assert torch.equal(out, reference)
    assert all(model.get_submodule(n).calls > 0 for n, t in towers_before.items() if n != "lm_head")


def _expected_params(c: MoTConfig) -> int:
    h, inner, ff = c.hidden_size, c.num_heads * c.head_dim, c.intermediate_size
    attention = 4 * h * inner  # reasoner q, k, v, out: no bias
    attention += 4 * h * inner + 3 * inner + h  # generation: with bias
    mlps = 2 * 3 * h * ff
    norms = 4 * h + 4 * c.head_dim
    top = 2 * c.vocab_size * h  # embed_tokens, lm_head
    top += (c.latent_channels * h + h) + (h * c.latent_channels + c.latent_channels)
    top += (TIME_FREQ_DIM * h + h) + (h * h + h) + 2 * h
    return c.num_layers * (attention + mlps + norms) + top


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_on_meta(preset):
    config = PRESETS[preset]
    model = build_model(config, device="meta")
    params = list(model.parameters())
    assert all(p.is_meta for p in params)
    assert all(p.dtype == torch.bfloat16 for p in params)
    total = sum(p.numel() for p in params)
    assert total == _expected_params(config)
    bounds = {"tiny": (1e5, 1e6), "demo": (3e6, 2e7), "nano": (2e9, 6e9), "super": (6.0e10, 6.8e10)}
    low, high = bounds[preset]
    assert low <= total <= high, f"{preset}: {total:,} parameters"


def test_tiny_preset_has_uneven_sizes():
    c = PRESETS["tiny"]
    assert (c.hidden_size, c.num_layers) == (64, 2)
    rows = (c.intermediate_size, c.latent_channels, c.vocab_size)
    for world in (3, 4):  # sharding tests need row counts that do not divide evenly
        assert any(r % world for r in rows), (world, rows)


def test_rope_buffer_is_real_and_not_persistent():
    for device in ("meta", "cpu"):
        model = build_model(PRESETS["tiny"], device=device)
        buffers = dict(model.named_buffers())
        inv_freq = buffers["rotary_emb.inv_freq"]
        assert not inv_freq.is_meta and inv_freq.dtype == torch.float32
        expected = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
        assert torch.equal(inv_freq, expected.float())
        assert "rotary_emb.inv_freq" not in model.state_dict()


def test_config_round_trip_and_refusals():
    config = PRESETS["demo"]
    d = config.to_config_dict()
    assert d["_class_name"] == "ReferenceMoTTransformer"
    assert list(d)[1:] == sorted(list(d)[1:])
    assert MoTConfig.from_config_dict({**d, "quantization_config": {}, "_diffusers_version": "x"}) == config
    with pytest.raises(ValueError, match="CosmosTransformer"):
        MoTConfig.from_config_dict({**d, "_class_name": "CosmosTransformer"})
    with pytest.raises(ValueError, match="unknown field `extra`"):
        MoTConfig.from_config_dict({**d, "extra": 1})
    with pytest.raises(ValueError, match="missing field `hidden_size`"):
        MoTConfig.from_config_dict({k: v for k, v in d.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="head_dim"):
        dataclasses.replace(config, head_dim=15)
    with pytest.raises(ValueError, match="dtype"):
        dataclasses.replace(config, dtype="float16x")


def test_swiglu_is_silu_of_the_gate_times_up():
    # silu(g) = g / (1 + e^-g), computed in float64 from math, not from torch's silu.
    gate = torch.tensor([-3.0, -0.5, 0.0, 0.5, 2.0, 8.0])
    up = torch.tensor([1.5, -2.0, 7.0, 3.0, -1.0, 0.25])
    expected = [g / (1 + math.exp(-g)) * u for g, u in zip(gate.tolist(), up.tolist())]
    torch.testing.assert_close(swiglu(gate, up), torch.tensor(expected), rtol=1e-6, atol=1e-7)
    assert swiglu(gate, up).tolist() != swiglu(up, gate).tolist()  # which input is the gate matters


def test_swiglu_mlp_is_the_llama_mlp():
    """gate_proj goes through the activation, up_proj does not: the Llama / Qwen layout the
    published names promise (transformers' own LlamaMLP on the same weights)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP

    from fsdp_fp8.models.ops import SwiGLUMLP

    ours = SwiGLUMLP(8, 12)
    config = transformers.LlamaConfig(
        hidden_size=8,
        intermediate_size=12,
        num_attention_heads=2,
        num_key_value_heads=2,
        hidden_act="silu",
        mlp_bias=False,
    )
    theirs = LlamaMLP(config)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))


def test_reasoner_is_causal_and_generation_is_not():
    model = tiny()
    ids = prompt()
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 100
    with torch.no_grad():
        a, b = model.reason(ids), model.reason(changed)
        for (ka, va), (kb, vb) in zip(a.kv, b.kv):
            assert torch.equal(ka[:, :, :-1], kb[:, :, :-1]) and torch.equal(va[:, :, :-1], vb[:, :, :-1])
            assert not torch.equal(ka[:, :, -1], kb[:, :, -1])
        assert a.kv[0][0].shape == (2, 4, 7, 16)
        x, t = latents(), torch.full((2,), 0.7)
        y = x.clone()
        y[:, -1] += 1.0
        out_x, out_y = model.denoise(x, t, a), model.denoise(y, t, a)
        assert out_x.shape == x.shape
        assert not torch.allclose(out_x[:, 0], out_y[:, 0])  # first token sees the last
        assert not torch.allclose(model.denoise(x, t, a), model.denoise(x, t, b))
        assert not torch.allclose(model.denoise(x, t, a), model.denoise(x, t, None))
        assert not torch.allclose(model.denoise(x, t, None), model.denoise(x, torch.full((2,), 0.2), None))


def test_bf16_model_computes_in_bf16_with_o1_activations():
    model = tiny(config=PRESETS["tiny"])
    with torch.no_grad():
        state = model.reason(prompt())
        out = model.denoise(latents(), torch.full((2,), 0.5), state)
    assert out.dtype == torch.bfloat16 and model.dtype == torch.bfloat16
    assert 0.1 < out.float().std().item() < 10.0
    assert 0.1 < state.hidden.float().std().item() < 10.0


def test_init_is_seeded_and_independent_of_device_of_construction():
    on_cpu = tiny(seed=1).state_dict()
    # Built on meta, given storage, then initialised: the sharded-load path's order.
    on_meta = build_model(TINY32, device="meta").to_empty(device="cpu")
    on_meta = init_weights(on_meta, seed=1).state_dict()
    assert sorted(on_meta) == sorted(on_cpu)
    assert all(torch.equal(on_meta[k], on_cpu[k]) for k in on_cpu)
    other_seed = tiny(seed=2).state_dict()
    assert not torch.equal(on_cpu["layers.0.self_attn.to_q.weight"], other_seed["layers.0.self_attn.to_q.weight"])
