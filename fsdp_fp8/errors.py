"""Every error type fsdp_fp8 raises on purpose, and the one way problems are reported.

A checking function appends to the ``problems`` list its caller passes down; the public boundary
raises once, with every problem sorted, as a ``ProblemsError`` subclass (:func:`raise_if_problems`,
the way safetensors' ``load_model`` reports all missing and unexpected keys together).
:func:`format_problems` is the one formatter: ``<context>: 2 problems:`` and a line per problem.

Distributed failures are ``RuntimeError``s: ``LoadFailedError`` (agreed by every rank),
``PeerLostError`` (a peer died or hung) and ``ModelUnusableError`` (a model whose load failed).

Design: docs/design.md, "Failure model".
"""

from __future__ import annotations

from collections.abc import Iterable


def format_problems(context: str, problems: Iterable[str]) -> str:
    """``"<context>: N problem(s):"`` and one ``"  - ..."`` line per problem, sorted, once each."""
    problems = sorted(set(problems))
    count = len(problems)
    lines = "\n".join(f"  - {p}" for p in problems)
    return f"{context}: {count} problem{'s' if count != 1 else ''}:\n{lines}"


class ProblemsError(Exception):
    """Problems found and listed once: ``problems`` holds every one, sorted, ``context`` what was checked."""

    default_context = "problems"

    def __init__(self, problems: Iterable[str] | str, context: str | None = None):
        self.problems: list[str] = sorted({problems} if isinstance(problems, str) else set(problems))
        self.context = context or self.default_context
        super().__init__(format_problems(self.context, self.problems))

    def __reduce__(self):  # pickles (e.g. across a process pipe) as its parts, not its message
        return type(self), (self.problems, self.context)


class CheckpointError(ProblemsError, ValueError):
    """A checkpoint, or a plan to load it into a model, cannot be used as it is."""

    default_context = "checkpoint"


class CheckpointPathError(CheckpointError, FileNotFoundError):
    """A path that names no checkpoint directory: missing, not a directory, or a hub name with no
    (or no safe) snapshot in the local cache. The user's to fix, so reported like every other
    ``CheckpointError`` (its problem alone, never where fsdp_fp8 raised it); a
    ``FileNotFoundError`` too, as ``open()`` of a missing path is."""

    default_context = "no checkpoint"


class ExportError(ProblemsError, ValueError):
    """A model cannot be written as a checkpoint (``export_fp8``, ``save_checkpoint``)."""

    default_context = "cannot export"


class QuantizeError(ProblemsError, ValueError):
    """Runtime quantization (``quantize_model``) refused the model or the options."""

    default_context = "cannot quantize the model"


class ArgumentError(ProblemsError, ValueError):
    """A value handed to fsdp_fp8 cannot work: an option, a keyword, a parallel layout, a
    tensor's construction arguments. Raised before anything changes, alike on every rank that was
    handed the same value (so the launcher prints it once)."""

    default_context = "invalid argument"


class ArgumentTypeError(ProblemsError, TypeError):
    """A value handed to fsdp_fp8 has the wrong type or name (an unknown keyword)."""

    default_context = "invalid argument"


class LayoutError(ArgumentError):
    """The ranks cannot be cut into the parallel layout asked for (``runtime.parallel_layout``):
    the degrees, the world size or the transformer's attention heads."""

    default_context = "parallel layout"


class LoadFailedError(ProblemsError, RuntimeError):
    """The load failed on at least one rank; every rank that agreed raises the same error.

    ``problems`` holds one entry per distinct error, prefixed with the ranks that raised it
    (``"rank 1: ..."``, ``"all 4 ranks: ..."``).
    """

    default_context = "checkpoint load failed"


class GenerationError(ProblemsError, RuntimeError):
    """Requests of a run failed; every rank of the world raises it alike (the engine's meetings
    carried each failure to every rank)."""

    default_context = "generation failed"


class PeerLostError(RuntimeError):
    """A collective failed: a peer died, dropped out, or did not arrive within the timeout
    (the load's agreements: their own, on a gloo side group; see ``fsdp_fp8.collective``).

    Raised instead of the backend's own error, with what this rank was doing, the timeout,
    the ranks that never arrived where known, and whether anything was changed. Any model
    involved is marked unusable first.
    """


class ModelUnusableError(RuntimeError):
    """Raised by the forward of a model whose load did not complete on every rank."""


def raise_if_problems(
    problems: Iterable[str], context: str | None = None, error: type[ProblemsError] = CheckpointError
) -> None:
    """The boundary: raise ``error(problems, context)`` once if anything was found."""
    problems = list(problems)
    if problems:
        raise error(problems, context)
