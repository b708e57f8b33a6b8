"""The step cache's option, as text: ``off`` or ``seacache[:THRESHOLD]`` (``--cache``,
``load_pipeline(cache=...)``). Imports nothing: the launcher checks its options before torch loads;
``interop.step_cache`` turns the parsed value into diffusers' own ``SeaCacheConfig``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    """``value`` as a ``CacheChoice`` (None: off); a bad value is a ``ValueError`` naming it."""
    problems = cache_option_problems(value, name)
    if problems:
        raise ValueError("; ".join(problems))
    if value is None or value == OFF:
        return None
    method, sep, threshold = value.partition(":")
    return CacheChoice(method, float(threshold) if sep else None)


__all__ = ["CACHE_METHODS", "CacheChoice", "cache_option_problems", "parse_cache_option"]
