"""Expert-parallel load balancing: redundant expert slots, balanced placements, and the planned moves that
rebalance a running model's experts (:mod:`functional_npu.parallel.eplb_map`,
:mod:`functional_npu.parallel.eplb_balance`)."""

from .parallel.eplb_balance import balanced_placement
from .parallel.eplb_map import (
    Move,
    RankProgram,
    RebalancePlan,
    default_placement,
    plan_rebalance,
    rank_program,
    rebalance,
    routing_table,
    validate_placement,
)

__all__ = [
    "validate_placement",
    "default_placement",
    "routing_table",
    "balanced_placement",
    "plan_rebalance",
    "rank_program",
    "rebalance",
    "RebalancePlan",
    "RankProgram",
    "Move",
]
