"""One declaration per option: a dataclass field whose metadata says everything about it.

A field made by :func:`option` carries its help text, its ``--help`` group, the kinds of run
that read it, its bounds and how the command line spells and parses it. Everything else is
made from the fields, never written twice:

- the launcher's argparse parser (``cli.arguments``) and ``inspect``'s shared options;
- ``uses(kind)``: which options a kind of run reads (an option it ignores is warned about);
- ``bound_problems``: the bounds, checked before anything loads (launcher and server alike);
- ``bounds_text``: the ``--help`` epilog's bounds; the option table of docs/usage.md.

No torch here: the launcher parses and checks its options before torch loads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

EVERY = "every"  # a kind name: an option every kind of run takes
OPTION = "option"  # the metadata key of a declared field


@dataclass(frozen=True)
class Bound:
    """Inclusive bounds; ``above``: the low end is excluded (``--fps`` must be > 0)."""

    low: float
    high: float
    above: bool = False

    def problem(self, name: str, value) -> str | None:
        """Why ``value`` is out of bounds, in the option's own words, or None."""
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            return None
        flag = "--" + name.replace("_", "-")
        if self.above and not value > self.low:  # NaN too
            return f"{flag} must be > {self.low:g}, got {value}"
        if not self.above and not value >= self.low:
            return f"{flag} must be >= {_number(self.low)}, got {_number(value)}"
        if not value <= self.high:  # inf too
            return f"{flag} must be <= {_number(self.high)}, got {_number(value)}"
        return None

    def text(self) -> str:
        if self.above:
            return f"above {self.low:g} and at most {_number(self.high)}"
        return f"{_number(self.low)}..{_number(self.high)}"


def _number(value) -> str:
    """Integers with thousands separators, floats as ``%g`` (``1e+09``), as the messages read."""
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


@dataclass(frozen=True)
class Option:
    """How one field is an option. ``kinds``: the kinds of run that read it (``EVERY``: all);
    ``cli``: the argparse keywords besides help and default (``type``, ``choices``, ``action``,
    ``metavar``); ``flags``: the command line's spellings (default ``--the-name``);
    ``per_request``: a served request may set it (the server's request body); ``check``: a
    check of its own besides the bound (the value -> its problems), where one module owns it."""

    help: str
    group: str
    kinds: frozenset[str]
    bound: Bound | None = None
    flags: tuple[str, ...] = ()
    cli: dict = dataclasses.field(default_factory=dict)
    per_request: bool = False
    check: Callable[[object], list[str]] | None = None


def option(
    default,
    help: str,
    group: str,
    kinds: str | tuple[str, ...],
    *,
    bound: tuple | Bound | None = None,
    flags: tuple[str, ...] = (),
    per_request: bool = False,
    check: Callable[[object], list[str]] | None = None,
    **cli,
):
    """A dataclass field that is one option (see ``Option``)."""
    kinds = (kinds,) if isinstance(kinds, str) else kinds
    if isinstance(bound, tuple):
        bound = Bound(*bound)
    meta = Option(help, group, frozenset(kinds), bound, flags, cli, per_request, check)
    return dataclasses.field(default=default, metadata={OPTION: meta})


def declared(*classes: type) -> list[tuple[str, dataclasses.Field, Option]]:
    """(name, field, Option) of every declared field of ``classes``, in declaration order."""
    return [(f.name, f, f.metadata[OPTION]) for cls in classes for f in dataclasses.fields(cls) if OPTION in f.metadata]


def flags_of(name: str, meta: Option) -> tuple[str, ...]:
    return meta.flags or ("--" + name.replace("_", "-"),)


def uses(kind: str, *classes: type) -> set[str]:
    """The options a run of ``kind`` reads (those every kind takes included)."""
    return {name for name, _, meta in declared(*classes) if kind in meta.kinds or EVERY in meta.kinds}


def bounds(*classes: type) -> dict[str, Bound]:
    return {name: meta.bound for name, _, meta in declared(*classes) if meta.bound is not None}


def bound_problems(values: object, *classes: type) -> list[str]:
    """Every declared bound and check that ``values`` (anything with the fields as attributes: a
    value, a ``Namespace``) breaks, one line each."""
    problems = []
    for name, _, meta in declared(*classes):
        value = getattr(values, name, None)
        if meta.bound is not None and (problem := meta.bound.problem(name, value)):
            problems.append(problem)
        if meta.check is not None and value is not None:
            problems += meta.check(value)
    return problems


def bounds_text(*classes: type) -> str:
    """The bounds as one sentence for ``--help``: ``--steps 1..10,000, --frames 1..1,024, ...``."""
    parts = [f"{flags_of(name, meta)[0]} {meta.bound.text()}" for name, _, meta in declared(*classes) if meta.bound]
    return ", ".join(parts)


def reference_rows(*classes: type) -> list[tuple[str, str, str, str]]:
    """(group, flags, default, help) per option, for the documentation's table."""
    rows = []
    for name, field, meta in declared(*classes):
        default = field.default
        shown = "" if default in (None, (), False) else f"`{default}`"
        flags = ", ".join(f"`{f}`" for f in flags_of(name, meta))
        rows.append((meta.group, flags, shown, meta.help))
    return rows


def take(cls: type, values: object, convert: Callable = lambda v: v) -> dict:
    """The fields of ``cls`` read from ``values`` (a ``Namespace``), each through ``convert``."""
    return {f.name: convert(getattr(values, f.name)) for f in dataclasses.fields(cls) if hasattr(values, f.name)}


__all__ = [
    "EVERY",
    "Bound",
    "Option",
    "bound_problems",
    "bounds",
    "bounds_text",
    "declared",
    "flags_of",
    "option",
    "reference_rows",
    "take",
    "uses",
]
