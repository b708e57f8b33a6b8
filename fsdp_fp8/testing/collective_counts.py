"""How many of a parallel layout's collectives a run made, for tests and benches: counted from
outside the production classes (which keep no counters of their own), for as long as a ``with``
block lasts.

    with counted(Ulysses, "_all_to_all") as all_to_alls, counted(CfgPair, "_exchange") as exchanges:
        pipe(...)
    all_to_alls.calls, exchanges.calls
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from fsdp_fp8.interop.forward_state import PIPELINE_STATE, PipelineState


@dataclass
class Count:
    calls: int = 0


@contextlib.contextmanager
def counted(cls: type, name: str) -> Iterator[Count]:
    """Count calls of ``cls.name`` (on every instance) inside the block; the method is restored on exit."""
    count = Count()
    original = cls.__dict__[name]

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        count.calls += 1
        return original(*args, **kwargs)

    setattr(cls, name, wrapper)
    try:
        yield count
    finally:
        setattr(cls, name, original)


def pipeline_state(transformer: nn.Module) -> PipelineState | None:
    """The per-forward state ``load_pipeline`` gave ``transformer`` (None: it gave none)."""
    return PIPELINE_STATE.get(transformer)
