"""What a load returns: ``LoadedModel``, plain fields about one loaded, sharded model."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fsdp_fp8.format.checkpoint import Checkpoint
from fsdp_fp8.load.plan import LoadPlan
from fsdp_fp8.load.reader import LoadReport
from fsdp_fp8.load.spec import ModelSpec


@dataclass
class LoadedModel:
    model: nn.Module
    checkpoint: Checkpoint  # its descriptors stay open: save_checkpoint reads the source through them
    plan: LoadPlan
    report: LoadReport
    fp8_linears: list[str]
    spec: ModelSpec  # what was built: the class config.json names (or the caller's model_fn), its kind and dtype
    towers: dict[str, str] | None = None  # linear name -> tower (fsdp_fp8.runtime.towers), when one is known
