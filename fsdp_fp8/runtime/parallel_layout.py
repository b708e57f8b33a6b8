"""The parallel layout: how many ranks, how they hold the weights and how they share the work,
validated once (torchtitan's ``ParallelDims``). ``runtime.parallel_mesh`` builds its one mesh.

Imports nothing but the error types (no torch): the launcher checks a layout before torch loads.
Every problem is one ``LayoutError``.

:class:`ParallelLayout` cuts ``W`` ranks two ways, row-major over the same ranks: the weight dims
``(replicate, shard)`` and the work dims ``(request, cfg, ulysses)``. The two cuts are independent.
Ulysses is innermost, so its all-to-alls stay among neighbouring ranks. ``ulysses_rows`` gives each
rank's generation rows: an equal share, at least ``MIN_ROWS``.

Design: docs/design.md, "One mesh: weights and work".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from fsdp_fp8.errors import LayoutError

WEIGHT_DIMS = ("replicate", "shard")
WORK_DIMS = ("request", "cfg", "ulysses")

# A rank's generation rows at the least: on the CPU build torch._scaled_mm's bits hold for row
# slices of 12 rows and more, not always below (interop.ulysses; the forecast counts them).
MIN_ROWS = 16


def ulysses_rows(length: int, size: int) -> int:
    """Each rank's generation rows for a pass of ``length`` rows over a Ulysses group of ``size``:
    an equal share, at least ``MIN_ROWS``; a pass shorter than that stays whole on the group's first
    rank (the others hold padding), so its GEMMs are the one-rank run's own."""
    return max(-(-length // size), min(length, MIN_ROWS))


@dataclass(frozen=True)
class AttentionHeads:
    """A transformer's attention heads, as the Ulysses degree must split them, and where they were read."""

    query: object
    key_value: object
    source: str = "transformer/config.json"

    @classmethod
    def of(cls, config: dict, source: str = "transformer/config.json") -> AttentionHeads:
        return cls(config.get("num_attention_heads"), config.get("num_key_value_heads"), source)


class Coordinates(NamedTuple):
    """One rank's place on the work dims."""

    request: int
    cfg: int
    ulysses: int


@dataclass(frozen=True)
class ParallelLayout:
    """``world`` ranks: ``replicas`` HSDP replica groups for the weights; CFG pairs and Ulysses
    groups of ``ulysses`` for the work; ``heads`` (optional) the transformer's attention heads the
    Ulysses degree must split. Every problem is one ``LayoutError``, raised on construction."""

    world: int
    cfg_parallel: bool = False
    ulysses: int = 1
    replicas: int = 1
    heads: AttentionHeads | None = None

    def __post_init__(self) -> None:
        problems = layout_problems(self.world, self.cfg_parallel, self.ulysses, self.replicas, self.heads)
        if problems:
            raise LayoutError(problems)

    @property
    def cfg(self) -> int:
        return 2 if self.cfg_parallel else 1

    @property
    def requests(self) -> int:
        """Requests run at once: the size of the ``request`` dim."""
        return self.world // (self.cfg * self.ulysses)

    @property
    def shard(self) -> int:
        """Ranks one parameter's rows are split over: the size of the ``shard`` dim."""
        return self.world // self.replicas

    def work_sizes(self) -> tuple[int, int, int]:
        """The sizes of ``WORK_DIMS``, in order."""
        return self.requests, self.cfg, self.ulysses

    def weight_sizes(self) -> tuple[int, int]:
        """The sizes of ``WEIGHT_DIMS``, in order."""
        return self.replicas, self.shard

    def coordinates(self, rank: int) -> Coordinates:
        """``rank``'s place on the work dims (row-major, ``ulysses`` innermost)."""
        return Coordinates(rank // (self.cfg * self.ulysses), rank // self.ulysses % self.cfg, rank % self.ulysses)

    def writes(self, rank: int) -> bool:
        """Whether ``rank`` reports and saves its requests (every rank of a request holds the same
        latents: the first one, cfg 0 and ulysses 0, writes)."""
        place = self.coordinates(rank)
        return place.cfg == 0 and place.ulysses == 0

    def describe(self) -> str:
        """The work dims in words, as the report prints them: ``CFG 2 x Ulysses 4``, ``Ulysses 2``,
        ``CFG 2``, or ``none``."""
        parts = (["CFG 2"] if self.cfg_parallel else []) + ([f"Ulysses {self.ulysses}"] if self.ulysses > 1 else [])
        return " x ".join(parts) or "none"


def _degree_problems(name: str, value) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, int):
        return [f"{name} must be an integer >= 1, got {value!r}"]
    return [f"{name} must be >= 1, got {value!r}"] if value < 1 else []


def layout_problems(
    world: int, cfg_parallel: bool, ulysses: int, replicas: int = 1, heads: AttentionHeads | None = None
) -> list[str]:
    """Why ``world`` ranks cannot be cut into ``replicas`` replica groups, CFG pairs and Ulysses
    groups of ``ulysses``, or ``heads`` split ``ulysses`` ways (empty: they can)."""
    problems = _degree_problems("the world size", world) + _degree_problems("the Ulysses degree", ulysses)
    problems += _degree_problems("replicas", replicas)
    if not isinstance(cfg_parallel, bool):
        problems.append(f"cfg_parallel must be a bool, got {cfg_parallel!r}")
    if problems:
        return problems
    if world % replicas:
        problems.append(
            f"replicas {replicas} does not divide the world size {world}: HSDP needs every replica group "
            "to have the same number of ranks"
        )
    return problems + _work_problems(world, cfg_parallel, ulysses) + head_problems(heads, ulysses)


def _work_problems(world: int, cfg_parallel: bool, ulysses: int) -> list[str]:
    team = (2 if cfg_parallel else 1) * ulysses
    if not world % team:
        return []
    what = f"CFG pairs of Ulysses groups of {ulysses} ({team} ranks per request)"
    if not cfg_parallel:
        what = f"Ulysses groups of {ulysses}"
    elif ulysses == 1:
        return [f"CFG-parallel runs ranks in pairs: it needs an even world size, got {world}"]
    ranks = f"{world} rank{'' if world == 1 else 's'}"
    return [f"a world of {ranks} cannot be cut into {what}: {team} must divide {world}"]


def head_problems(heads: AttentionHeads | None, ulysses: int) -> list[str]:
    """Why a Cosmos 3 transformer with ``heads`` cannot split its attention over a Ulysses group of
    ``ulysses``. Each rank takes a contiguous slice of the query heads and the key/value heads those
    use (GQA): the degree must divide the query heads, and either divide the key/value heads (each
    rank its own) or be a multiple of them (ranks share one, repeated)."""
    if heads is None or ulysses == 1:
        return []
    q, kv, source = heads.query, heads.key_value, heads.source
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (q, kv)) or q % kv:
        return [
            f"{source}: `num_attention_heads` {q!r} / `num_key_value_heads` {kv!r} are not positive "
            "integers with the key/value heads dividing the query heads, so the heads cannot be split"
        ]
    if q % ulysses or (kv % ulysses and ulysses % kv):
        return [
            f"a Ulysses degree of {ulysses} cannot split this transformer's attention: it has "
            f"{q} query heads and {kv} key/value heads ({source}); each rank of a Ulysses group "
            f"takes an equal share of the query heads and of the key/value heads they use, so the degree "
            f"must divide {q} and divide {kv} or be a multiple of it"
        ]
    return []
