"""Moved to ``fsdp_fp8.collective`` (the agreement is its own layer); these names stay here
for the modules that still import them from the load layer."""

from fsdp_fp8.collective.agreement import (  # noqa: F401
    ASSUMED_READ_BYTES_PER_S,
    ASSUMED_WRITE_BYTES_PER_S,
    DEFAULT_TIMEOUT_S,
    agree_or_raise,
    merge_rank_problems,
    outcome_timeout_s,
    ranks_label,
)
from fsdp_fp8.collective.facts import checkpoint_facts, model_facts, plan_facts  # noqa: F401
from fsdp_fp8.collective.group import distributed, exchange, side_group  # noqa: F401
