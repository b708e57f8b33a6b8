"""One collective phase: a body that runs on each rank alone, then exactly one agreement.

::

    with collective_phase(model, "load", timeout_s, failed="checkpoint load failed"):
        ...  # local work only: swap, shard, materialize, read (no agreement inside)
    # here every rank succeeded, or every rank raised the same error

The body's exception is this rank's outcome, exchanged once at the exit. On any failure ``model``
is marked unusable and every rank raises the same error; a failed exchange is a ``PeerLostError``.

Design: docs/design.md, "The two pipelines"; docs/reliability.md, "Guarantees".
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from fsdp_fp8.collective.agreement import merge_rank_problems
from fsdp_fp8.collective.group import distributed, exchange, rank_and_world
from fsdp_fp8.collective.unusable import mark_unusable
from fsdp_fp8.errors import LoadFailedError, PeerLostError, ProblemsError

log = logging.getLogger(__name__)


def agree_on_outcome(ok: bool, message: str, timeout_s: float, stage: str) -> list[tuple[int, str]]:
    """Every rank's failure as (rank, message), the same list on every rank; a single process
    reports its own. One exchange; a ``PeerLostError`` if it fails."""
    rank, _ = rank_and_world()
    if not distributed():
        return [] if ok else [(rank, message)]
    gathered = exchange(
        (rank, ok, message), timeout_s=timeout_s, stage=f"agreement on the outcome of the {stage}", context=""
    )
    return [(r, msg) for r, rank_ok, msg in gathered if not rank_ok]


@contextlib.contextmanager
def collective_phase(
    model,
    stage: str,
    timeout_s: float,
    *,
    failed: str | None = None,
    error: type[ProblemsError] = LoadFailedError,
) -> Iterator[None]:
    """Run the body locally; on exit, one agreement on every rank's outcome.

    ``stage`` names the phase in the exchange (``"agreement on the outcome of the <stage>"``);
    ``failed`` opens the error (default ``"<stage> failed"``); ``error`` is raised with one
    problem per distinct failure, prefixed by the ranks that had it. ``model`` (``None``:
    nothing to mark) is marked unusable on any failure, on every rank.
    """
    failed = failed or f"{stage} failed"
    rank, world = rank_and_world()
    ok, message, cause = True, "", None
    try:
        yield
    except Exception as exc:  # every rank must learn of it: raised below, after the agreement
        ok, message, cause = False, f"{type(exc).__name__}: {exc}", exc
        log.error("rank %d: %s: %s", rank, failed, message)
    try:
        failures = agree_on_outcome(ok, message, timeout_s, stage)
    except PeerLostError as exc:  # a peer died, failed, or was slower than the timeout
        reason = str(exc) if ok else f"rank {rank}: {message}; {exc}"
        if model is not None:
            mark_unusable(model, reason)
        raise PeerLostError(f"{failed}: {reason}") from exc
    if failures:
        problems = merge_rank_problems(failures, world)
        if model is not None:
            mark_unusable(model, "; ".join(problems))
        raise error(problems, f"{failed} on {len(failures)} of {world} ranks") from cause
