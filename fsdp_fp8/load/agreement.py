"""Ranks agree before anyone mutates: one small collective, then all raise or none does.

Each rank validates the checkpoint and the plan on its own; if ranks could see different
files (a shard rewritten on one node) or one rank found a problem, proceeding would end
in a hang at the first all-gather or in silently different weights. So every rank
exchanges its verdict and a digest of what it read (file names, sizes, header SHA-256),
and every rank raises the same ``CheckpointError`` listing every rank's problems (each
distinct problem once, with the ranks that found it: ``all 4 ranks: ...``, ``rank 1: ...``). A rank
whose peer never takes part (it died, or hangs until the process-group timeout) raises a
``RuntimeError`` instead of gloo's bare error, still before anything is mutated.
"""

from __future__ import annotations

import torch.distributed as dist

from fsdp_fp8.errors import CheckpointError, PeerLostError


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


def checkpoint_identity(checkpoint) -> tuple:
    return tuple(sorted((f.name, f.size, f.header_sha256) for f in checkpoint.files.values()))


def agree_or_raise(problems: list[str], identity: tuple | None, context: str) -> None:
    """Collective when a process group is up; raises the union of all ranks' problems."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if problems:
            raise CheckpointError(problems, context)
        return
    verdicts: list = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(verdicts, (dist.get_rank(), sorted(problems), identity))
    except Exception as exc:  # a peer died before agreeing, or hung past the process-group timeout
        own = f"; this rank's own problems: {sorted(problems)}" if problems else ""
        raise PeerLostError(
            f"{context}: rank {dist.get_rank()} could not exchange verdicts with the other ranks "
            f"(a peer died, failed or hung past the process-group timeout); nothing was changed"
            f"{own}: {type(exc).__name__}: {exc}") from exc
    merged = merge_rank_problems([(rank, p) for rank, rank_problems, _ in verdicts for p in rank_problems],
                                 len(verdicts))
    identities = {ident for _, rank_problems, ident in verdicts if not rank_problems}
    if len(identities) > 1:
        by_rank = ", ".join(f"rank {r}: {len(i or ())} files" for r, _, i in verdicts)
        merged.append(
            "ranks see different checkpoint files (sizes or header digests differ; "
            f"a shard changed on one node?): {by_rank}"
        )
    if merged:
        raise CheckpointError(merged, context)
