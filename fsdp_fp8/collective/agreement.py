"""Ranks agree before anyone mutates: all raise or none does.

:func:`agreement_before_changes` is a context manager whose body runs on each rank alone and
whose exit is the single agreement. An exception in the body is this rank's problem, not raised
where it happened: a rank that raised alone would strand its peers in the exchange. In the body,
``pending.facts`` is what the ranks must have read and built alike, and ``pending.on_refusal(fn)``
runs ``fn`` with the error on every rank if any rank refuses.

One exchange carries each rank's problems and a SHA-256 per component of its facts; only differing
components travel a second time. Every rank then raises the same ``CheckpointError``.

Design: docs/design.md, "The two pipelines"; docs/reliability.md, "Guarantees".
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch.distributed as dist

from fsdp_fp8.collective.group import distributed, exchange
from fsdp_fp8.errors import CheckpointError, ProblemsError

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


def outcome_timeout_s(slowest_rank_bytes: int, base_s: float) -> float:
    """``base_s`` plus the time the slowest rank needs for its ``slowest_rank_bytes`` at
    ``ASSUMED_READ_BYTES_PER_S``: a rank behind on slow storage is not mistaken for a hung one."""
    return base_s + slowest_rank_bytes / ASSUMED_READ_BYTES_PER_S


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
    problems: list[str],
    facts: dict[str, dict[str, str]] | None,
    context: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    *,
    share: object = None,
    error: type[ProblemsError] = CheckpointError,
    stage: str = "agreement before loading",
) -> list:
    """Collective when a process group is up; raises the union of all ranks' problems and every
    disagreement between the ranks' facts, the same ``error`` on every rank. Returns every rank's
    ``share`` in rank order (a small value the ranks hand each other in the same exchange)."""
    if not distributed():
        if problems:
            raise error(problems, context)
        return [share]
    world = dist.get_world_size()
    digests = None if facts is None else {c: _digest(items) for c, items in facts.items()}
    verdicts = exchange(
        (dist.get_rank(), sorted(problems), digests, share),
        timeout_s=timeout_s,
        stage=stage,
        context=context,
        before_changes=True,
    )
    merged = merge_rank_problems([(rank, p) for rank, rank_problems, _, _ in verdicts for p in rank_problems], world)
    compared = [d for _, _, d, _ in verdicts if d is not None]
    components = sorted(set().union(*compared)) if compared else []
    differ = [
        c
        for c in components
        if len({d.get(c) for _, _, d, _ in verdicts if d is not None}) > 1
        or any(d is not None and c not in d for _, _, d, _ in verdicts)
    ]
    if differ:  # every rank computed the same list, so every rank takes part
        mine = None if facts is None else {c: facts.get(c) for c in differ}
        details = exchange(
            mine, timeout_s=timeout_s, stage="comparison of what the ranks read", context=context, before_changes=True
        )
        for c in differ:
            merged += _differences(c, [None if d is None else d.get(c) for d in details], world)
    if merged:
        raise error(merged, context)
    return [shared for _, _, _, shared in verdicts]


# Exceptions that report bad input (a missing file, a refused config): their message is the
# problem. Any other exception in an agreement's body is unexpected and names where it rose.
INPUT_ERRORS = (ValueError, KeyError, OSError)


@dataclass
class Pending:
    """What this rank brings to an ``agreement_before_changes``: its problems, the facts the ranks compare
    and what to undo if any rank refuses."""

    problems: list[str] = field(default_factory=list)
    facts: dict[str, dict[str, str]] | None = None  # None: this rank has a problem (nothing to compare)
    cause: BaseException | None = None  # an unexpected exception, kept for its traceback
    undo: list[Callable[[BaseException], object]] = field(default_factory=list)

    def on_refusal(self, fn: Callable[[BaseException], object]) -> None:
        """Run ``fn(error)`` on this rank if the agreement refuses (the error every rank raises)."""
        self.undo.append(fn)

    def refuse(self, exc: Exception) -> None:
        """``exc`` as this rank's problem: a ``ProblemsError``'s problems, an input error's
        message, or any other exception with the place it was raised (and kept as ``cause``)."""
        self.facts = None
        if isinstance(exc, ProblemsError):
            self.problems += exc.problems
        elif isinstance(exc, INPUT_ERRORS):
            self.problems.append(f"{type(exc).__name__}: {exc}")
        else:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            self.problems.append(
                f"{type(exc).__name__}: {exc} (raised at {where.filename}:{where.lineno} in {where.name})"
            )
            self.cause = exc


@contextlib.contextmanager
def agreement_before_changes(context: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[Pending]:
    """Run the body on this rank alone; its exit is one ``agree_or_raise`` over what the body left
    in the ``Pending`` it yields. On a refusal (any rank's problem, facts that differ, a lost peer)
    every ``on_refusal`` function runs, last first, and every rank raises the same error."""
    pending = Pending()
    try:
        yield pending
    except Exception as exc:  # this rank's outcome: every rank learns it in the agreement below
        pending.refuse(exc)
    try:
        agree_or_raise(pending.problems, pending.facts, context, timeout_s)
    except BaseException as exc:
        for undo in reversed(pending.undo):
            undo(exc)
        if isinstance(exc, ProblemsError) and pending.cause is not None:
            raise exc from pending.cause  # the traceback of the unexpected exception shows under it
        raise
