"""A Llama-shaped ModelOpt static-FP8 checkpoint for the peer benchmark, written without
fsdp_fp8's writer (``safetensors.torch.save_file``, the layout ``export_hf_checkpoint`` of
ModelOpt 0.47 produces for ``LlamaForCausalLM``: the committed fixture
``tests/fixtures/modelopt-0.47-llama-sharded`` is the same layout at toy size).

    python -m bench.peer_checkpoints [--size llama-0.7g] [--dir DIR]

Every quantized linear has an ``float8_e4m3fn`` weight and 0-d float32 ``weight_scale`` and
``input_scale``; embeddings, norms and the head stay BF16 (``ignore``: ``lm_head``,
``model.embed_tokens``). Data is seeded random bytes (FP8 codes with the lowest bit cleared, so
no E4M3 NaN pattern 0x7F / 0xFF occurs). Shards of at most ``max_shard_bytes`` in key order, an
index with the weight map, ``config.json`` with the quantization config, ``hf_quant_config.json``.
Written once under the benchmark cache (``$FSDP_FP8_BENCH_DIR``, default ``$TMPDIR/fsdp_fp8_bench``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from bench import common

MODELOPT_VERSION = "0.47.0"
IGNORE = ["lm_head", "model.embed_tokens"]


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_shard_bytes: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# "llama-0.7g": 0.70 GB (10 layers of a TinyLlama-like block, 32000 x 2048 BF16 embeddings and head),
# in 4 shard files, so that DCP's per-file reader threads have files to share.
SHAPES = {
    "llama-0.7g": LlamaShape(
        hidden=2048, layers=10, heads=32, kv_heads=4, intermediate=5632, vocab=32000, max_shard_bytes=200 << 20
    ),
    # "llama-3.4g": 3.58 GB (3.3 GiB) in 16 shard files: Llama-3-8B's hidden 4096 and MLP 14336, 14 of its
    # layers, a 32000-token vocabulary (issue 40's load-at-the-speed-of-storage checkpoint).
    "llama-3.4g": LlamaShape(
        hidden=4096, layers=14, heads=32, kv_heads=8, intermediate=14336, vocab=32000, max_shard_bytes=240 << 20
    ),
    "llama-tiny": LlamaShape(
        hidden=64, layers=2, heads=4, kv_heads=2, intermediate=136, vocab=301, max_shard_bytes=24 << 10
    ),
}


def config_dict(shape: LlamaShape) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "dtype": "bfloat16",
        "eos_token_id": 2,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden,
        "initializer_range": 0.02,
        "intermediate_size": shape.intermediate,
        "max_position_embeddings": 2048,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": shape.heads,
        "num_hidden_layers": shape.layers,
        "num_key_value_heads": shape.kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": shape.vocab,
        "quantization_config": {
            "config_groups": {
                "group_0": {
                    "input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                    "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
                    "targets": ["Linear"],
                }
            },
            "ignore": IGNORE,
            "quant_algo": "FP8",
            "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
            "quant_method": "modelopt",
        },
    }


def tensor_specs(shape: LlamaShape) -> list[tuple[str, str, tuple[int, ...]]]:
    """(key, kind, shape) in state-dict order; kind: fp8 | bf16 | scale."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    out = [("model.embed_tokens.weight", "bf16", (shape.vocab, h))]
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        linears = [
            ("self_attn.q_proj", (h, h)),
            ("self_attn.k_proj", (kv, h)),
            ("self_attn.v_proj", (kv, h)),
            ("self_attn.o_proj", (h, h)),
            ("mlp.gate_proj", (shape.intermediate, h)),
            ("mlp.up_proj", (shape.intermediate, h)),
            ("mlp.down_proj", (h, shape.intermediate)),
        ]
        for name, dims in linears:
            out += [
                (f"{p}.{name}.weight", "fp8", dims),
                (f"{p}.{name}.weight_scale", "scale", ()),
                (f"{p}.{name}.input_scale", "scale", ()),
            ]
        out += [(f"{p}.input_layernorm.weight", "bf16", (h,)), (f"{p}.post_attention_layernorm.weight", "bf16", (h,))]
    out += [("model.norm.weight", "bf16", (h,)), ("lm_head.weight", "bf16", (shape.vocab, h))]
    return out


def _tensor(kind: str, dims: tuple[int, ...], gen):
    import torch

    if kind == "scale":
        return torch.tensor(0.004 + 0.01 * torch.rand((), generator=gen).item(), dtype=torch.float32)
    if kind == "fp8":
        codes = torch.randint(0, 256, dims, dtype=torch.uint8, generator=gen) & 0xFE  # no 0x7F / 0xFF
        return codes.view(torch.float8_e4m3fn)
    if len(dims) == 1:  # norms
        return torch.ones(dims, dtype=torch.bfloat16)
    return (torch.randn(dims, generator=gen) * 0.02).to(torch.bfloat16)


def _nbytes(kind: str, dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return {"scale": 4, "fp8": 1, "bf16": 2}[kind] * n


def write_llama_checkpoint(shape: LlamaShape, directory: Path, seed: int = 0) -> Path:
    """Write the checkpoint into an empty or missing ``directory``; returns it."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    specs = tensor_specs(shape)
    shards: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    size = 0
    for spec in specs:  # greedy in key order, as transformers' save_pretrained shards
        n = _nbytes(spec[1], spec[2])
        if shards[-1] and size + n > shape.max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += n
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for i, specs_i in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {key: _tensor(kind, dims, gen) for key, kind, dims in specs_i}
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({key: name for key in tensors})
        del tensors
    params = sum(int(torch.Size(d).numel()) for _, k, d in specs if k != "scale")
    index = {
        "metadata": {"total_parameters": params, "total_size": total},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (directory / "config.json").write_text(json.dumps(config_dict(shape), indent=4) + "\n")
    quant = {
        "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": IGNORE},
    }
    (directory / "hf_quant_config.json").write_text(json.dumps(quant, indent=4) + "\n")
    gen_config = {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2, "use_cache": True}
    (directory / "generation_config.json").write_text(json.dumps(gen_config, indent=2) + "\n")
    return directory


def llama_checkpoint(size: str = "llama-0.7g", root=None) -> Path:
    """The ``size`` checkpoint, written once and cached under ``root`` (a file lock serialises writers)."""
    from fsdp_fp8.export.cache import build_once

    def build(directory: Path) -> None:
        write_llama_checkpoint(SHAPES[size], directory / "fp8")
        (directory / "done").write_text("ok\n")

    target = build_once(Path(root or common.default_cache()) / size, build, lambda d: (d / "done").exists())
    return target / "fp8"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SHAPES), default="llama-0.7g")
    p.add_argument("--dir", help="cache root (default $FSDP_FP8_BENCH_DIR or $TMPDIR/fsdp_fp8_bench)")
    args = p.parse_args(argv)
    path = llama_checkpoint(args.size, args.dir)
    files = common.checkpoint_files(path)
    print(f"{path}: {len(files)} files, {common.mib(sum(f.stat().st_size for f in files))} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
