"""Ranks agreeing, in one place: the gloo side group and its exchange (``group``), what each
rank describes (``facts``), the agreement before anything changes (``agreement``), one
collective phase whose exit is the single agreement on its outcome (``phase``), and what a
failed phase leaves behind (``unusable``); what fsdp_fp8 remembers about other libraries'
objects, held weakly in one place (``attached``). Imports only ``errors`` (and ``format``).
"""

from fsdp_fp8.collective.agreement import (
    ASSUMED_READ_BYTES_PER_S,
    ASSUMED_WRITE_BYTES_PER_S,
    DEFAULT_TIMEOUT_S,
    agree_or_raise,
    merge_rank_problems,
    outcome_timeout_s,
    ranks_label,
)
from fsdp_fp8.collective.facts import checkpoint_facts, model_facts, plan_facts
from fsdp_fp8.collective.group import distributed, exchange, rank_and_world, side_group
from fsdp_fp8.collective.phase import agree_on_outcome, collective_phase
from fsdp_fp8.collective.unusable import mark_unusable, storage_tensors, unusable_reason

__all__ = [
    "ASSUMED_READ_BYTES_PER_S",
    "ASSUMED_WRITE_BYTES_PER_S",
    "DEFAULT_TIMEOUT_S",
    "agree_on_outcome",
    "agree_or_raise",
    "checkpoint_facts",
    "collective_phase",
    "distributed",
    "exchange",
    "mark_unusable",
    "merge_rank_problems",
    "model_facts",
    "outcome_timeout_s",
    "plan_facts",
    "rank_and_world",
    "ranks_label",
    "side_group",
    "storage_tensors",
    "unusable_reason",
]
