"""Configuration and presets of the reference mixture-of-transformers denoiser."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_fp8.errors import ArgumentError

CLASS_NAME = "ReferenceMoTTransformer"
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class MoTConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    latent_channels: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        problems = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (type(value) is not int or value <= 0):
                problems.append(f"`{f.name}` must be a positive int, got {value!r}")
        if type(self.head_dim) is int and self.head_dim % 2:
            problems.append(f"`head_dim` must be even for RoPE, got {self.head_dim}")
        for name in ("rope_theta", "rms_eps"):
            value = getattr(self, name)
            # `not value > 0` is also true for NaN; inf passes a sign test but builds garbage
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                problems.append(f"`{name}` must be a finite number > 0, got {value!r}")
        if self.dtype not in _DTYPES:
            problems.append(f"`dtype` must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if problems:
            raise ArgumentError(problems, "invalid MoTConfig")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def to_config_dict(self) -> dict[str, Any]:
        """A diffusers-style ``config.json`` body (keys sorted, as diffusers writes them)."""
        fields = dataclasses.asdict(self)
        return {"_class_name": CLASS_NAME, **{k: fields[k] for k in sorted(fields)}}

    @classmethod
    def from_config_dict(cls, d: dict[str, Any]) -> MoTConfig:
        class_name = d.get("_class_name")
        if class_name != CLASS_NAME:
            raise ArgumentError(
                f"config.json `_class_name` is {class_name!r}; this reference model reads only {CLASS_NAME!r}"
            )
        # `_`-prefixed bookkeeping and the quantization block belong to other readers.
        body = {k: v for k, v in d.items() if not k.startswith("_") and k != "quantization_config"}
        known = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        problems = [f"unknown field `{k}`" for k in body if k not in known]
        problems += [f"missing field `{k}`" for k in required if k not in body]
        if problems:
            raise ArgumentError(problems, "config.json")
        return cls(**body)


PRESETS: dict[str, MoTConfig] = {
    # Tests: sizes that divide by neither 3 nor 4 (88, 6, 100 rows) exercise uneven sharding.
    "tiny": MoTConfig(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        head_dim=16,
        intermediate_size=88,
        vocab_size=100,
        latent_channels=6,
    ),
    # ~7.0M parameters (14 MB in BF16): a 4-rank CPU run loads it and samples in seconds.
    "demo": MoTConfig(
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        head_dim=64,
        intermediate_size=688,
        vocab_size=1000,
        latent_channels=16,
    ),
    # Realistic shapes, for meta-device planning only (~3.7B parameters).
    "nano": MoTConfig(
        hidden_size=2048,
        num_layers=28,
        num_heads=16,
        head_dim=128,
        intermediate_size=6144,
        vocab_size=151936,
        latent_channels=64,
        rope_theta=1000000.0,
    ),
    # ~63B parameters: two 64-layer towers of ~31B each.
    "super": MoTConfig(
        hidden_size=5120,
        num_layers=64,
        num_heads=64,
        head_dim=128,
        intermediate_size=20480,
        vocab_size=151936,
        latent_channels=64,
        rope_theta=1000000.0,
    ),
}
