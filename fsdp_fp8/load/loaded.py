"""What a load returns: ``LoadedModel``, plain fields about one loaded, sharded model."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fsdp_fp8.format.checkpoint import Checkpoint
from fsdp_fp8.load.plan import LoadPlan
from fsdp_fp8.load.reader import LoadReport
from fsdp_fp8.load.release import release_model
from fsdp_fp8.load.spec import ModelSpec


@dataclass
class LoadedModel:
    """A loaded model and what it was loaded from. ``close()`` (or leaving ``with load_model(...)
    as loaded:``) lets it go at once: ``fsdp_fp8.load.release``."""

    model: nn.Module
    checkpoint: Checkpoint  # its descriptors stay open: save_checkpoint reads the source through them
    plan: LoadPlan
    report: LoadReport
    fp8_linears: list[str]
    spec: ModelSpec  # what was built: the class config.json names (or the caller's model_fn), its kind and dtype
    towers: dict[str, str] | None = None  # linear name -> tower (fsdp_fp8.runtime.towers), when one is known

    def close(self) -> None:
        """Free every storage the load made on this rank now (not when the garbage collector
        finds FSDP2's reference cycles), close the checkpoint's files, and leave the model
        refusing to run or be saved. Local: every rank closes its own. A second call does nothing."""
        release_model(self.model)
        self.checkpoint.close()

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
