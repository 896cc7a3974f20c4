"""Where experts live: routing statistics, balancedness, placement, rebalancing
policies and the move plan between two placements (numpy and CPU torch only).

Glossary: a logical expert is an expert of the model (E per layer); a physical expert
or slot is a copy hosted on a rank (P = E + redundant per layer). phy2log [L, P],
log2phy [L, E, max_replicas] (-1 padded), logcnt [L, E]: DeepSeek EPLB's names.
"""

from balancer.balancedness import Prediction, compute_balancedness, compute_par, predict
from balancer.config import BalancerConfig, RebalanceDecision, should_rebalance
from balancer.forecast import Forecast, forecast_load
from balancer.history import (
    HistoryDecision,
    HistoryOptions,
    full_horizon,
    plan_from_history,
    rebalance_from_history,
)
from balancer.move_plan import MovePlan, Transfer, compute_move_plan
from balancer.placement import Placement, compute_log2phy
from balancer.policy import POLICIES, rebalance_experts
from balancer.stats import Diagnostics, RoutingStats

__all__ = [
    "POLICIES",
    "BalancerConfig",
    "Diagnostics",
    "Forecast",
    "HistoryDecision",
    "HistoryOptions",
    "MovePlan",
    "Placement",
    "Prediction",
    "RebalanceDecision",
    "RoutingStats",
    "Transfer",
    "compute_balancedness",
    "compute_log2phy",
    "compute_move_plan",
    "compute_par",
    "forecast_load",
    "full_horizon",
    "plan_from_history",
    "predict",
    "rebalance_experts",
    "rebalance_from_history",
    "should_rebalance",
]
