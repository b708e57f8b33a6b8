"""The one error type for checkpoints and load plans that cannot be used as they are."""

from __future__ import annotations

from collections.abc import Iterable


class CheckpointError(ValueError):
    """A checkpoint, or a plan to load it, has problems; ``problems`` lists every one, sorted.

    Raised once, after everything was checked, so a user sees the whole list at once
    (the way safetensors' ``load_model`` reports all missing and unexpected keys together).
    """

    def __init__(self, problems: Iterable[str], context: str = "checkpoint"):
        self.problems: list[str] = sorted(set(problems))
        self.context = context
        count = len(self.problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{context}: {count} problem{'s' if count != 1 else ''}:\n{lines}")


def raise_if_problems(problems: Iterable[str], context: str = "checkpoint") -> None:
    problems = list(problems)
    if problems:
        raise CheckpointError(problems, context)
