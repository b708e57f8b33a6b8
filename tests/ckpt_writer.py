"""Write small test checkpoints, in any config spelling, corrupt them byte by byte, and read
them back byte for byte (``raw_tensors``)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

PRODUCER = {"name": "modelopt", "version": "0.47.0"}
SCHEME = {"num_bits": 8, "type": "float", "dynamic": False}


def nested_config(ignore=("lm_head",), kv=None) -> dict:
    return {
        "producer": dict(PRODUCER),
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": kv, "exclude_modules": list(ignore)},
    }


def flat_config(ignore=("lm_head",)) -> dict:
    return {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": list(ignore)}


def config_json_quant(ignore=("lm_head",), kv=False, policy=None) -> dict:
    q = {
        "quant_method": "modelopt",
        "quant_algo": "FP8",
        "ignore": list(ignore),
        "producer": dict(PRODUCER),
        "config_groups": {
            "group_0": {"weights": dict(SCHEME), "input_activations": dict(SCHEME), "targets": ["Linear"]}
        },
    }
    if kv:
        q["kv_cache_scheme"] = dict(SCHEME)
    if policy is not None:
        q["runtime"] = {"diffusion_step_policy": policy}
    return q


def fp8_linear(
    name: str,
    out_features: int,
    in_features: int,
    *,
    bias: bool = False,
    weight_scale: float = 0.01,
    input_scale: float = 0.02,
    seed: int = 0,
) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g).clamp(-400, 400).to(torch.float8_e4m3fn)
    tensors = {
        f"{name}.weight": w,
        f"{name}.weight_scale": torch.tensor(weight_scale),
        f"{name}.input_scale": torch.tensor(input_scale),
    }
    if bias:
        tensors[f"{name}.bias"] = torch.randn(out_features, generator=g).to(torch.bfloat16)
    return tensors


def small_tensors(bias: bool = False) -> dict:
    """Two FP8 linears, a norm and an lm_head: matches ``SmallModel`` in the plan tests."""
    tensors = {
        **fp8_linear("layers.0.up", 24, 16, bias=bias, seed=1),
        **fp8_linear("layers.0.down", 16, 24, seed=2, weight_scale=0.03),
        "norm.weight": torch.ones(16, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(40, 16).to(torch.bfloat16),
    }
    return tensors


def write_checkpoint(
    directory: Path,
    tensors: dict,
    *,
    quant: str | None = "nested",
    shards: list[list[str]] | None = None,
    config: dict | None = None,
    hf_quant: dict | None = None,
    stem: str = "model",
) -> Path:
    """``quant``: "nested" | "flat" | "config" | "both" (nested + config.json) | None.

    ``shards`` lists the keys of each shard; None writes ``<stem>.safetensors``.
    ``hf_quant`` / ``config`` override what ``quant`` would write.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(config if config is not None else {"model_type": "test"})
    if quant in ("config", "both"):
        config.setdefault("quantization_config", config_json_quant())
    if hf_quant is None and quant in ("nested", "both"):
        hf_quant = nested_config()
    if hf_quant is None and quant == "flat":
        hf_quant = flat_config()
    (directory / "config.json").write_text(json.dumps(config))
    if hf_quant is not None:
        (directory / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    if shards is None:
        save_file(tensors, directory / f"{stem}.safetensors", metadata={"format": "pt"})
        return directory
    weight_map = {}
    for i, keys in enumerate(shards):
        name = f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k] for k in keys}, directory / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in keys})
    write_index(directory, weight_map, stem)
    return directory


def write_index(directory: Path, weight_map: dict, stem: str = "model") -> None:
    (Path(directory) / f"{stem}.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


def read_raw(path: Path) -> tuple[dict, bytes]:
    """The header object and the data region of a safetensors file."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_raw(path: Path, header: dict | bytes, data: bytes, header_len: int | None = None) -> None:
    """Write a safetensors file from parts; ``header_len`` overrides the length prefix."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(text) if header_len is None else header_len
    Path(path).write_bytes(struct.pack("<Q", length) + text + data)


def edit_header(path: Path, edit) -> None:
    """Apply ``edit(header_dict)`` in place, keeping the data region."""
    header, data = read_raw(path)
    edit(header)
    write_raw(path, header, data)


def set_scalar(path: Path, key: str, value: float) -> None:
    """Overwrite the bytes of one F32 scale in place."""
    header, _ = read_raw(path)
    (n,) = struct.unpack("<Q", Path(path).read_bytes()[:8])
    begin = 8 + n + header[key]["data_offsets"][0]
    with open(path, "r+b") as f:
        f.seek(begin)
        f.write(struct.pack("<f", value))


def raw_tensors(directory) -> dict[str, tuple[str, bytes]]:
    """key -> (safetensors dtype, bytes), read with safetensors itself."""
    from safetensors import safe_open

    out = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                out[key] = (
                    f.get_slice(key).get_dtype(),
                    f.get_tensor(key).reshape(-1).view(torch.uint8).numpy().tobytes(),
                )
    return out
