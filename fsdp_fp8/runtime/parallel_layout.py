"""Which ranks work together on one request: sequence groups, CFG pairs and prompt slots.

Imports nothing (no torch): the launcher checks a layout before torch loads.

A world of ``W`` ranks runs ``W / (cfg x sp)`` requests at once (prompt *slots*); the ranks of
one slot split one request: ``cfg`` is 2 under CFG-parallel (the two guidance passes of a step
at once) and 1 otherwise; ``sp`` is the sequence-parallel degree (the generation tokens of one
pass split over a *sequence group*). Ranks are laid out with the sequence group innermost, so
its all-to-alls, the busiest collectives, stay among neighbouring ranks (one node under torchrun's
node-major rank order), then the CFG role, then the slot::

    rank = (slot x cfg + role) x sp + position

    world 8, CFG-parallel, sp 4:   slot 0: role 0 (cond)   ranks 0 1 2 3   <- one sequence group
                                           role 1 (uncond) ranks 4 5 6 7   <- another
                                   CFG pairs: (0, 4) (1, 5) (2, 6) (3, 7)

    world 8, sp 2, no CFG:         slots 0..3, sequence groups (0, 1) (2, 3) (4, 5) (6, 7)

Without either, every rank is its own slot (today's prompt spreading); with CFG-parallel alone the
pairs are ``(2k, 2k + 1)``. FSDP2 keeps sharding the weights over every rank (or each HSDP
replica group): the layout decides who computes what, not who holds which rows.
"""

from __future__ import annotations

from dataclasses import dataclass

# A rank's generation rows at the least: on the CPU build torch._scaled_mm's bits hold for row
# slices of 12 rows and more, not always below (interop.sequence_parallel; the forecast counts them).
MIN_ROWS = 16


def sequence_rows(length: int, size: int) -> int:
    """Each rank's generation rows for a pass of ``length`` rows over a sequence group of ``size``:
    an equal share, at least ``MIN_ROWS``; a pass shorter than that stays whole on the group's first
    rank (the others hold padding), so its GEMMs are the one-rank run's own."""
    return max(-(-length // size), min(length, MIN_ROWS))


@dataclass(frozen=True)
class ParallelLayout:
    rank: int
    world: int
    cfg_parallel: bool = False
    sequence_parallel: int = 1

    def __post_init__(self) -> None:
        problems = layout_problems(self.world, self.cfg_parallel, self.sequence_parallel)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def cfg(self) -> int:
        return 2 if self.cfg_parallel else 1

    @property
    def team(self) -> int:
        """Ranks serving one request."""
        return self.cfg * self.sequence_parallel

    @property
    def slot(self) -> int:
        return self.rank // self.team

    @property
    def slots(self) -> int:
        return self.world // self.team

    @property
    def role(self) -> int:
        """0: the conditional pass (or both passes without CFG-parallel); 1: the unconditional one."""
        return self.rank // self.sequence_parallel % self.cfg

    @property
    def position(self) -> int:
        """This rank's place in its sequence group: its share of the generation tokens."""
        return self.rank % self.sequence_parallel

    @property
    def writes(self) -> bool:
        """Whether this rank reports and saves its requests (every rank of a slot holds the same
        latents: the first one writes)."""
        return self.role == 0 and self.position == 0

    def sequence_groups(self) -> list[list[int]]:
        """Every sequence group of the world, in the order every rank creates them."""
        sp = self.sequence_parallel
        return [list(range(start, start + sp)) for start in range(0, self.world, sp)]

    def cfg_pairs(self) -> list[list[int]]:
        """Every CFG pair of the world (the ranks at one position of a slot's two roles), in order."""
        sp = self.sequence_parallel
        return [
            [(slot * 2) * sp + position, (slot * 2 + 1) * sp + position]
            for slot in range(self.slots)
            for position in range(sp)
        ]

    def describe(self) -> str:
        """The mesh in words, as the report prints it: ``CFG 2 x SP 4``, ``SP 2``, ``CFG 2``."""
        parts = (["CFG 2"] if self.cfg_parallel else []) + (
            [f"SP {self.sequence_parallel}"] if self.sequence_parallel > 1 else []
        )
        return " x ".join(parts) or "none"


def layout_problems(world: int, cfg_parallel: bool, sequence_parallel: int) -> list[str]:
    """Why ``world`` ranks cannot be cut into CFG pairs and sequence groups of ``sequence_parallel``."""
    if isinstance(sequence_parallel, bool) or not isinstance(sequence_parallel, int) or sequence_parallel < 1:
        return [f"the sequence-parallel degree must be an integer >= 1, got {sequence_parallel!r}"]
    team = (2 if cfg_parallel else 1) * sequence_parallel
    if world % team:
        what = f"CFG pairs of sequence groups of {sequence_parallel} ({team} ranks per request)"
        if not cfg_parallel:
            what = f"sequence groups of {sequence_parallel}"
        elif sequence_parallel == 1:
            return [f"CFG-parallel runs ranks in pairs: it needs an even world size, got {world}"]
        ranks = f"{world} rank{'' if world == 1 else 's'}"
        return [f"a world of {ranks} cannot be cut into {what}: {team} must divide {world}"]
    return []


def head_problems(config: dict, sequence_parallel: int, source: str = "transformer/config.json") -> list[str]:
    """Why a Cosmos 3 transformer with ``config`` cannot split its attention heads over a sequence
    group of ``sequence_parallel``. Each rank takes a contiguous slice of the query heads and the
    key/value heads those use (GQA): the degree must divide the query heads, and either divide the
    key/value heads (each rank its own) or be a multiple of them (ranks share one, repeated)."""
    if sequence_parallel == 1:
        return []
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (heads, kv_heads)) or heads % kv_heads:
        return [
            f"{source}: `num_attention_heads` {heads!r} / `num_key_value_heads` {kv_heads!r} are not positive "
            "integers with the key/value heads dividing the query heads, so the heads cannot be split"
        ]
    if heads % sequence_parallel or (kv_heads % sequence_parallel and sequence_parallel % kv_heads):
        return [
            f"--sequence-parallel {sequence_parallel} cannot split this transformer's attention: it has "
            f"{heads} query heads and {kv_heads} key/value heads ({source}); each rank of a sequence group "
            f"takes an equal share of the query heads and of the key/value heads they use, so the degree "
            f"must divide {heads} and divide {kv_heads} or be a multiple of it"
        ]
    return []
