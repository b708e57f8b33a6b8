"""Small models and checkpoints for the sharded-load tests.

``UnevenModel`` has linears whose row counts do not divide by 2, 3 or 4 (7 and 16 rows,
and a 1-row linear: fewer rows than ranks), a persistent buffer that is in the
checkpoint and a non-persistent one that is not, and a high-precision head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from ckpt_writer import nested_config, write_checkpoint
from torch import nn
from torch.nn import functional as F

FIXTURE = Path(__file__).parent / "fixtures" / "modelopt-0.47-llama-sharded"
HIDDEN = 16


class UnevenBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.Parameter(torch.ones(HIDDEN))
        self.up = nn.Linear(HIDDEN, 7, bias=True)
        self.down = nn.Linear(7, HIDDEN, bias=False)
        self.gate = nn.Linear(HIDDEN, 1, bias=True)

    def forward(self, x):
        h = x * self.norm
        h = x + self.down(F.silu(self.up(h)))
        return h * torch.sigmoid(self.gate(h))


class UnevenModel(nn.Module):
    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        self.layers = nn.ModuleList([UnevenBlock(), UnevenBlock()])
        self.head = nn.Linear(HIDDEN, 6, bias=False)
        self.register_buffer("shift", torch.zeros(HIDDEN))
        # In no checkpoint: garbage here after to_empty would change every output.
        self.register_buffer("ramp", torch.arange(HIDDEN, dtype=torch.float32) / 64, persistent=False)
        self.to(dtype)

    def forward(self, x):
        x = x + self.shift + self.ramp.to(x.dtype)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def uneven_model_fn(config: dict) -> nn.Module:
    return UnevenModel()


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().max() / 448
    return (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.reshape(())


def uneven_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Checkpoint tensors for ``UnevenModel``: every block linear FP8, head BF16."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(2):
        p = f"layers.{i}"
        tensors[f"{p}.norm"] = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(torch.bfloat16)
        for name, (rows, cols, bias) in {
            "up": (7, HIDDEN, True),
            "down": (HIDDEN, 7, False),
            "gate": (1, HIDDEN, True),
        }.items():
            codes, scale = quantize_per_tensor(torch.randn(rows, cols, generator=g) / cols**0.5)
            tensors[f"{p}.{name}.weight"] = codes
            tensors[f"{p}.{name}.weight_scale"] = scale.float()
            tensors[f"{p}.{name}.input_scale"] = torch.tensor(3.0 / 448)
            if bias:
                tensors[f"{p}.{name}.bias"] = (0.1 * torch.randn(rows, generator=g)).to(torch.bfloat16)
    tensors["head.weight"] = (torch.randn(6, HIDDEN, generator=g) / 4).to(torch.bfloat16)
    tensors["shift"] = (0.05 * torch.randn(HIDDEN, generator=g)).to(torch.bfloat16)
    return tensors


def write_uneven_checkpoint(directory: Path, seed: int = 0) -> Path:
    """Three shards; every scale lives in a different shard than its weight."""
    tensors = uneven_tensors(seed)
    scales = sorted(k for k in tensors if k.endswith("_scale"))
    rest = sorted(k for k in tensors if k not in scales)
    shards = [rest[: len(rest) // 2], rest[len(rest) // 2 :], scales]
    return write_checkpoint(directory, tensors, shards=shards, hf_quant=nested_config(ignore=("head",)))


def load_files(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, read whole with safetensors (the reference)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(f))
    return out


# --- a Llama with the fixture's module names (enough to load it; no forward needed) ----------


class _Attn(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, d = c["hidden_size"], c["head_dim"]
        self.q_proj = nn.Linear(h, c["num_attention_heads"] * d, bias=False)
        self.k_proj = nn.Linear(h, c["num_key_value_heads"] * d, bias=False)
        self.v_proj = nn.Linear(h, c["num_key_value_heads"] * d, bias=False)
        self.o_proj = nn.Linear(c["num_attention_heads"] * d, h, bias=False)


class _Mlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)


class _Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = _Attn(c)
        self.mlp = _Mlp(c)
        self.input_layernorm = nn.RMSNorm(c["hidden_size"])
        self.post_attention_layernorm = nn.RMSNorm(c["hidden_size"])


class _Body(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList([_Layer(c) for _ in range(c["num_hidden_layers"])])
        self.norm = nn.RMSNorm(c["hidden_size"])


class FixtureLlama(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.model = _Body(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        self.to(torch.bfloat16)


def fixture_llama_fn(config: dict) -> nn.Module:
    return FixtureLlama(config)


def fixture_config() -> dict:
    return json.loads((FIXTURE / "config.json").read_text())


def random_fp8_linear(in_features: int, out_features: int, device, seed: int = 0, kernels=None):
    """A ``Float8StaticLinear`` (BF16, with bias) holding random E4M3 codes, weight scale 0.01,
    input scale 0.02 and a random bias; returned with its generator, to draw inputs from next.
    ``kernels``: its ``KernelOptions`` (default: the default kernels)."""
    from fsdp_fp8.fp8.kernels import DEFAULT_KERNELS
    from fsdp_fp8.fp8.linear import Float8StaticLinear

    g = torch.Generator().manual_seed(seed)
    lin = Float8StaticLinear(
        in_features, out_features, True, torch.bfloat16, device=device, kernels=kernels or DEFAULT_KERNELS
    )
    with torch.no_grad():
        lin.weight.qdata.copy_((torch.randn(out_features, in_features, generator=g) * 64).to(torch.float8_e4m3fn))
        lin.weight.scale.fill_(0.01)
        lin.weight.act_quant_scale.fill_(0.02)
        lin.bias.copy_(torch.randn(out_features, generator=g))
    return lin, g


def what_still_runs(model) -> dict:
    """After a failed or closed load: which modules of an ``UnevenModel`` (and their ``forward``)
    still compute on a batch, and the storage bytes the model still holds."""
    from fsdp_fp8 import ModelUnusableError
    from fsdp_fp8.load.meta_build import storage_tensors

    computing = []
    for name, module in model.named_modules():
        for call in (module, module.forward):
            try:
                call(torch.zeros(1, 2, HIDDEN, dtype=torch.bfloat16))
            except ModelUnusableError:
                continue
            except Exception:  # noqa: BLE001 - computed something (or tried): counted
                pass
            computing.append(name or "(root)")
    held = 0
    for t in [*model.parameters(), *model.buffers()]:
        held += sum(x.untyped_storage().nbytes() for x in storage_tensors(t) if not x.is_meta)
    return {"computing": sorted(set(computing)), "held_bytes": held}


# --- the plan tests' small model ---------------------------------------------------------


class Block(nn.Module):
    def __init__(self, bias=False):
        super().__init__()
        self.up = nn.Linear(16, 24, bias=bias)
        self.down = nn.Linear(24, 16, bias=False)


class SmallModel(nn.Module):
    def __init__(self, bias=False, dtype=torch.bfloat16):
        super().__init__()
        self.layers = nn.ModuleList([Block(bias)])
        self.norm = nn.LayerNorm(16, bias=False)
        self.lm_head = nn.Linear(16, 40, bias=False)
        self.to(dtype)


def meta(cls=SmallModel, **kw):
    with torch.device("meta"):
        return cls(**kw)


# --- a Llama of the ModelOpt fixture's config, on the meta device ------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, d = c["hidden_size"], c["head_dim"]
        self.q_proj = nn.Linear(h, c["num_attention_heads"] * d, bias=c["attention_bias"])
        self.k_proj = nn.Linear(h, c["num_key_value_heads"] * d, bias=c["attention_bias"])
        self.v_proj = nn.Linear(h, c["num_key_value_heads"] * d, bias=c["attention_bias"])
        self.o_proj = nn.Linear(c["num_attention_heads"] * d, h, bias=c["attention_bias"])


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=c["mlp_bias"])
        self.up_proj = nn.Linear(h, i, bias=c["mlp_bias"])
        self.down_proj = nn.Linear(i, h, bias=c["mlp_bias"])


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn, self.mlp = Attention(c), MLP(c)
        self.input_layernorm = RMSNorm(c["hidden_size"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"])


class Body(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Layer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"])
        # A non-persistent buffer is not in the checkpoint and must not be reported missing.
        self.register_buffer("inv_freq", torch.ones(c["head_dim"] // 2), persistent=False)


class Llama(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.model = Body(c)
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)


def llama_on_meta(dtype=torch.bfloat16) -> nn.Module:
    config = json.loads((FIXTURE / "config.json").read_text())
    with torch.device("meta"):
        return Llama(config).to(dtype)
