"""Ranks agreeing, in one place: the gloo side group and its exchange (``group``), the agreement
before anything changes (``agreement``: ``agreement_before_changes``, ``agree_or_raise``), one
collective phase whose exit is the single agreement on its outcome (``phase``), the settings every
rank must share, agreed before the mesh is built (``settings``), and what a
failed phase leaves behind (``unusable``); the weak map every record about another library's
object is (``attached``). Takes plain values (problems, facts as dicts of strings, byte counts);
imports only ``errors``.
"""

from fsdp_fp8.collective.agreement import (
    ASSUMED_READ_BYTES_PER_S,
    ASSUMED_WRITE_BYTES_PER_S,
    DEFAULT_TIMEOUT_S,
    Pending,
    agree_or_raise,
    agreement_before_changes,
    merge_rank_problems,
    outcome_timeout_s,
    ranks_label,
)
from fsdp_fp8.collective.group import distributed, exchange, rank_and_world, side_group
from fsdp_fp8.collective.phase import agree_on_outcome, collective_phase
from fsdp_fp8.collective.settings import agree_on_settings, settings_problems
from fsdp_fp8.collective.unusable import mark_unusable, storage_tensors, unusable_reason

__all__ = [
    "ASSUMED_READ_BYTES_PER_S",
    "ASSUMED_WRITE_BYTES_PER_S",
    "DEFAULT_TIMEOUT_S",
    "agree_on_outcome",
    "agree_on_settings",
    "Pending",
    "agree_or_raise",
    "agreement_before_changes",
    "collective_phase",
    "distributed",
    "exchange",
    "mark_unusable",
    "merge_rank_problems",
    "outcome_timeout_s",
    "rank_and_world",
    "ranks_label",
    "settings_problems",
    "side_group",
    "storage_tensors",
    "unusable_reason",
]
