"""Ranks agree before anyone mutates: all raise or none does.

One exchange carries each rank's problems and a SHA-256 per component of its facts
(``fsdp_fp8.collective.facts``); only when digests differ does a second exchange carry those
components' facts, so every rank can name the same differing keys and values. Every rank then
raises the same ``CheckpointError`` (each distinct problem once, with the ranks that found it:
``all 4 ranks: ...``, ``rank 1: ...``). The exchanges run on the gloo side group
(``fsdp_fp8.collective.group``) with their own timeout.
"""

from __future__ import annotations

import hashlib
import json

import torch.distributed as dist

from fsdp_fp8.collective.group import distributed, exchange
from fsdp_fp8.errors import CheckpointError

DEFAULT_TIMEOUT_S = 300.0  # the wait for a peer before anything is read (opening, planning)
# Sizes the wait for the outcome of the reads: the slowest rank reads its forecast bytes at
# no less than this (slow network storage), on top of the base timeout.
ASSUMED_READ_BYTES_PER_S = 50e6
# Sizes the wait for the outcome of a save's writes: every rank may write into one shared
# filesystem at once (and syncs), so the whole save's bytes at no less than this, in all.
ASSUMED_WRITE_BYTES_PER_S = 50e6
MAX_NAMED_DIFFERENCES = 5  # per component, in the error; the count of the rest follows


def ranks_label(ranks: list[int], world_size: int) -> str:
    """``all 4 ranks``, ``ranks 0, 2`` or ``rank 1``."""
    ranks = sorted(set(ranks))
    if world_size > 1 and len(ranks) == world_size:
        return f"all {world_size} ranks"
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def merge_rank_problems(found: list[tuple[int, str]], world_size: int) -> list[str]:
    """One line per distinct problem, saying which ranks found it: a problem every rank
    has is one problem, not ``world_size`` of them."""
    by_problem: dict[str, list[int]] = {}
    for rank, problem in found:
        by_problem.setdefault(problem, []).append(rank)
    return [f"{ranks_label(ranks, world_size)}: {problem}" for problem, ranks in by_problem.items()]


def outcome_timeout_s(plan, world_size: int, base_s: float) -> float:
    """``base_s`` plus the time the slowest rank needs for its forecast bytes at
    ``ASSUMED_READ_BYTES_PER_S``: a rank behind on slow storage is not mistaken for a hung one."""
    slowest = max(plan.rank_bytes(world_size, rank) for rank in range(world_size))
    return base_s + slowest / ASSUMED_READ_BYTES_PER_S


def _digest(items: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(items.items())).encode()).hexdigest()


def _differences(component: str, by_rank: list[dict[str, str] | None], world: int) -> list[str]:
    keys = sorted(set().union(*(d for d in by_rank if d is not None)))
    found = []
    for key in keys:
        values = [None if d is None else d.get(key) for d in by_rank]
        if len(set(values)) == 1:
            continue
        groups: dict = {}
        for rank, value in enumerate(values):
            groups.setdefault(value, []).append(rank)
        said = "; ".join(
            f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {'(absent)' if v is None else v}"
            for v, r in groups.items()
        )
        found.append(f"`{key}` differs: {said}")
    shown = found[:MAX_NAMED_DIFFERENCES]
    more = f" (and {len(found) - len(shown)} more)" if len(found) > len(shown) else ""
    if not found:  # the same items, differently ordered or typed: still not the same input
        return [f"ranks disagree on {component}: the digests differ"]
    return [f"ranks disagree on {component}{more}: {d}" for d in shown]


def agree_or_raise(
    problems: list[str], facts: dict[str, dict[str, str]] | None, context: str, timeout_s: float = DEFAULT_TIMEOUT_S
) -> None:
    """Collective when a process group is up; raises the union of all ranks' problems and every
    disagreement between the ranks' facts, the same ``CheckpointError`` on every rank."""
    if not distributed():
        if problems:
            raise CheckpointError(problems, context)
        return
    world = dist.get_world_size()
    digests = None if facts is None else {c: _digest(items) for c, items in facts.items()}
    verdicts = exchange(
        (dist.get_rank(), sorted(problems), digests),
        timeout_s=timeout_s,
        stage="agreement before loading",
        context=context,
        before_changes=True,
    )
    merged = merge_rank_problems([(rank, p) for rank, rank_problems, _ in verdicts for p in rank_problems], world)
    compared = [d for _, _, d in verdicts if d is not None]
    components = sorted(set().union(*compared)) if compared else []
    differ = [
        c
        for c in components
        if len({d.get(c) for _, _, d in verdicts if d is not None}) > 1
        or any(d is not None and c not in d for _, _, d in verdicts)
    ]
    if differ:  # every rank computed the same list, so every rank takes part
        mine = None if facts is None else {c: facts.get(c) for c in differ}
        details = exchange(
            mine, timeout_s=timeout_s, stage="comparison of what the ranks read", context=context, before_changes=True
        )
        for c in differ:
            merged += _differences(c, [None if d is None else d.get(c) for d in details], world)
    if merged:
        raise CheckpointError(merged, context)
