"""Where the ranks of a round meet, besides a request's first forward: at every denoising step's
end and once the round's requests are done. Each meeting is one exchange of a small note over
the gloo agreement group (``collective.exchange``), so a failure, a cancel or a step's progress
reaches every rank at the same place and every rank acts on it alike::

    first forward    the request gate (interop.request_agreement): fingerprints, or a failure
                     before it: every rank stops before any step
    each step end    StepNote: a failure between steps, the writer's progress, rank 0's cancels:
                     a failure or a round whose requests are all cancelled stops every rank's
                     loop at this step (diffusers' ``interrupt``); a cancelled request beside
                     another that runs on keeps its ranks in the FSDP all-gathers, its result dropped
    the round's end  every rank's result row and its own failure

A rank that fails inside a transformer forward (in the middle of FSDP's collectives) cannot meet
the others at a boundary: its peers' collective fails or times out, which is a lost rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_fp8.collective import distributed, exchange


@dataclass(frozen=True)
class StepNote:
    """One rank's note at a step's end: its failure (None: well), its request's progress when it
    writes one (``(key, index, step, steps)``), and, from rank 0, the keys cancelled so far."""

    failure: str | None = None
    progress: tuple | None = None
    cancels: frozenset[str] = frozenset()


@dataclass
class StepMeeting:
    """The step meetings of one round: ``steps`` of them at most; closed after the last one or
    after one that stopped the round."""

    steps: int
    timeout_s: float
    round_keys: frozenset[str] | None = None  # the keys of the round's tasks (None: one has none)
    met: int = 0
    stopped: str | None = None  # why the round stopped: the failures met, in words
    failed_ranks: list[int] = field(default_factory=list)
    cancelled: frozenset[str] = frozenset()

    @property
    def open(self) -> bool:
        return self.stopped is None and self.met < self.steps

    @property
    def all_cancelled(self) -> bool:
        """Every task of the round was cancelled: the round stops."""
        return bool(self.round_keys) and self.round_keys <= self.cancelled

    def meet(self, note: StepNote) -> list[StepNote]:
        """Every rank's note for this step (collective over the world; this rank's alone in one
        process); records a stop and the cancels."""
        self.met += 1
        notes = [note]
        if distributed():
            notes = exchange(note, timeout_s=self.timeout_s, stage=f"meeting after step {self.met}", context="")
        failures = [(rank, n.failure) for rank, n in enumerate(notes) if n.failure is not None]
        if failures:
            self.failed_ranks = [rank for rank, _ in failures]
            self.stopped = "; ".join(f"rank {rank}: {message}" for rank, message in failures)
        self.cancelled = self.cancelled | notes[0].cancels
        return notes


@dataclass(frozen=True)
class RoundEnd:
    """One rank's note at the round's end: its result row (the writer of a real request), and
    its own failure, if it had one."""

    row: object | None = None
    failure: str | None = None


def meet_at_end(note: RoundEnd, timeout_s: float) -> list[RoundEnd]:
    """Every rank's ``RoundEnd`` (collective over the world; this rank's alone in one process)."""
    if not distributed():
        return [note]
    return exchange(note, timeout_s=timeout_s, stage="meeting after the round's requests", context="")


__all__ = ["RoundEnd", "StepMeeting", "StepNote", "meet_at_end"]
