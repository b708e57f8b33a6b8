"""Settings every rank must share, agreed before the mesh is built.

Ranks given different settings would otherwise run apart: two ranks of one CFG pair with
different attention backends each end with their own latent; ranks with different layouts build
different meshes and hang in their first collective. ``agree_on_settings`` exchanges each rank's
settings (a small dict of plain values) once over the agreement group and raises one
``ArgumentError`` on every rank naming each setting that differs and which ranks hold which value:
every rank computes the same list from the same exchanged values, so every rank raises alike.
"""

from __future__ import annotations

from fsdp_fp8.collective.group import distributed, exchange
from fsdp_fp8.errors import ArgumentError

MAX_VALUE_CHARS = 80  # a value longer than this (a step policy dict, say) is shown shortened
_ABSENT = object()


def _shown(value) -> str:
    if value is _ABSENT:
        return "(absent)"
    text = repr(value)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 3] + "..."


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def settings_problems(every_rank_settings: list[dict]) -> list[str]:
    """One line per setting whose value is not the same on every rank (``every_rank_settings``:
    each rank's settings, in rank order), naming the setting and which ranks hold which value:
    ``attention_backend differs between ranks: rank 0 'native'; rank 1 'flex'``."""
    names: dict[str, None] = {}
    for settings in every_rank_settings:
        names.update(dict.fromkeys(settings))
    problems = []
    for name in names:
        holders: dict[str, list[int]] = {}
        for rank, settings in enumerate(every_rank_settings):
            holders.setdefault(_shown(settings.get(name, _ABSENT)), []).append(rank)
        if len(holders) > 1:
            said = "; ".join(f"{_ranks(ranks)} {value}" for value, ranks in holders.items())
            problems.append(f"{name} differs between ranks: {said}")
    return problems


def agree_on_settings(settings: dict, *, timeout_s: float, context: str) -> None:
    """Collective under a process group of several ranks (nothing without one): every rank's
    ``settings`` compared; any difference is one ``ArgumentError`` on every rank, each problem
    naming the setting and the ranks on each side. Call it before the mesh is built and before
    anything is read. A lost peer is the exchange's ``PeerLostError``."""
    if not distributed():
        return
    every = exchange(
        dict(settings), timeout_s=timeout_s, stage="agreement on the settings", context=context, before_changes=True
    )
    problems = settings_problems(every)
    if problems:
        raise ArgumentError(problems, f"{context}: the ranks were given different settings, which must match")


__all__ = ["agree_on_settings", "settings_problems"]
