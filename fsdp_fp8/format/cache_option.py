"""The step cache's option, as text: ``off`` or ``seacache[:THRESHOLD]`` (``--cache``,
``load_pipeline(cache=...)``). Imports nothing: the launcher checks its options before torch loads;
``interop.step_cache`` turns the parsed value into diffusers' own ``SeaCacheConfig``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fsdp_fp8.errors import ArgumentError

CACHE_METHODS = ("seacache",)  # diffusers' SeaCache (hooks/sea_cache.py); the only one so far
OFF = "off"


@dataclass(frozen=True)
class CacheChoice:
    """A parsed ``--cache``: the method and its threshold (None: diffusers' own default)."""

    method: str
    threshold: float | None = None

    def describe(self) -> str:
        """``seacache`` or ``seacache:0.3``, as the option is written."""
        return self.method if self.threshold is None else f"{self.method}:{self.threshold:g}"


def cache_option_problems(value: object, name: str = "--cache") -> list[str]:
    """Why ``value`` is not ``off`` or ``seacache[:THRESHOLD]`` (a finite threshold >= 0); empty: it is."""
    if value is None or value == OFF:
        return []
    if not isinstance(value, str):
        return [f"{name} must be text (off or seacache[:THRESHOLD]), got {value!r}"]
    method, _, threshold = value.partition(":")
    if method not in CACHE_METHODS:
        return [f"{name} {value!r}: the method must be off or one of {', '.join(CACHE_METHODS)}"]
    if not _:
        return []
    try:
        number = float(threshold)
    except ValueError:
        return [f"{name} {value!r}: the threshold {threshold!r} is not a number"]
    if not (math.isfinite(number) and number >= 0):
        return [f"{name} {value!r}: the threshold must be a finite number >= 0, got {threshold}"]
    return []


def parse_cache_option(value: str | None, name: str = "--cache") -> CacheChoice | None:
    """``value`` as a ``CacheChoice`` (None: off); a bad value is an ``ArgumentError`` naming it."""
    problems = cache_option_problems(value, name)
    if problems:
        raise ArgumentError(problems, "cannot use the step cache")
    if value is None or value == OFF:
        return None
    method, sep, threshold = value.partition(":")
    return CacheChoice(method, float(threshold) if sep else None)


def computed_steps_range(
    precisions: list[str], retention: int = 1, end: int = 1, most_in_row: int = 2
) -> tuple[int, int]:
    """(fewest, most) steps a request computes out of ``len(precisions)`` (``precisions``: each
    step's, from the step policy) under SeaCache's rules and ours: the first ``retention`` and last
    ``end`` steps compute, at most ``most_in_row`` steps are reused in a row, and a step whose
    precision differs from the last computed step's computes. The fewest is the schedule a budget
    that never fills takes (reuse wherever the rules allow: the first step of each precision's run
    computes, then at most ``most_in_row`` reused, which no other order beats); the most is every
    step. The indicator decides where in between a request lands."""
    n, computed, in_row, last = len(precisions), 0, 0, None
    for i, precision in enumerate(precisions):
        forced = i < retention or i >= n - end or precision != last
        if forced or (most_in_row and in_row >= most_in_row):
            computed, in_row, last = computed + 1, 0, precision
        else:
            in_row += 1
    return computed, n


__all__ = ["CACHE_METHODS", "CacheChoice", "cache_option_problems", "computed_steps_range", "parse_cache_option"]
