"""What a load builds: a ``ModelSpec``, resolved before the load starts and handed to it whole.

The load itself knows no model class: the caller's ``model_fn``, or the class a checkpoint's
``config.json`` names (``fsdp_fp8.interop.architectures.resolve_model_spec``), arrives here as
a function of the config dict, with the tower map the step policy routes by and the dtype the
model is built in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_fp8.errors import ArgumentError

# linear name -> "reasoner" | "generation" | "other" (fsdp_fp8.runtime.towers), or a function of
# the built model returning that map
TowerSpec = Mapping[str, str] | Callable[[nn.Module], Mapping[str, str]]

KINDS = ("mot", "causal_lm", "transformers", "diffusers", "custom")


@dataclass(frozen=True)
class ModelSpec:
    name: str  # the class config.json names, or the caller's model_fn's name
    kind: str  # one of KINDS: what runs it (``custom``: the caller's own model_fn)
    model_fn: Callable[[dict], nn.Module]
    towers: TowerSpec | None = None  # the tower map for the step policy, when one is known
    dtype: torch.dtype | None = None  # what an HF model is built in (None: the model decides)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ArgumentError(f"ModelSpec.kind is {self.kind!r}, not one of {list(KINDS)}")


def custom_spec(model_fn: Callable[[dict], nn.Module], towers: TowerSpec | None = None) -> ModelSpec:
    """The spec of a caller's own ``model_fn`` (its tower map: the caller's, or found later from
    the built model's class)."""
    return ModelSpec(getattr(model_fn, "__name__", type(model_fn).__name__), "custom", model_fn, towers)
