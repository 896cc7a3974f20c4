"""BalancerConfig (vLLM's EPLB names) and the rebalancing trigger."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from balancer.history import LINK_BYTES_PER_S
from balancer.policy import POLICIES
from balancer.stats import RoutingStats

MIGRATION_METHODS = ("p2p", "reload")

# vLLM's `--eplb-config` calls our "auto" policy "default".
_POLICY_ALIASES = {"default": "auto"}
TRIGGERS = ("forecast", "interval")


@dataclass(frozen=True)
class BalancerConfig:
    """enable_eplb: turn the balancer on; num_redundant_experts: extra slots per layer;
    window_size: steps of statistics kept; step_interval: steps between rebalances of the
    interval trigger (None: not given, 3000 when that trigger runs);
    policy: "auto" | "hierarchical" | "global" | "deepseek" ("default" = "auto");
    log_balancedness: log avg_tokens, max_tokens, balancedness each step;
    min_balancedness_to_skip: a due rebalance is skipped when balancedness >= this;
    rebalance_below_balancedness: rebalance early once a full window falls below this
    (0 disables); use_async: accepted from vLLM's config for the runtime's transport;
    migration_method: how moved experts reach their new slots, "p2p" (isend/irecv from the
    rank that holds a copy) or "reload" (each rank re-reads them from the checkpoint: no peer
    traffic, suits a shared fast filesystem).

    trigger: "forecast": every check_interval steps ask balancer.rebalance_from_history
    on the last window_size steps, which moves only when the predicted PAR gain pays for
    the moved slots; "interval": vLLM's fixed schedule (every step_interval steps on the
    window's sum, should_rebalance). None (default): "interval" when step_interval is
    given (vLLM's names give vLLM's behaviour), else "forecast".
    full_check_interval: a full evaluation at least this often; the checks in between
    (those after which the next check still comes within full_check_interval steps of the
    last full one; none when check_interval > full_check_interval / 2) first ask whether
    the last check_interval steps are balanced as well as the steps before them and stay
    cheaply if so (HistoryOptions.early_stay): a burst is answered within check_interval
    steps at little CPU.
    step_seconds: modeled seconds one step costs per unit of peak-to-average ratio
    (the competition's 60 / trace steps); transfer_bytes_per_s: link speed that prices a
    moved slot (expert bytes / this); move_margin: a move must gain this x its cost."""

    enable_eplb: bool = False
    num_redundant_experts: int = 0
    window_size: int = 1000
    step_interval: int | None = None
    policy: str = "auto"
    log_balancedness: bool = False
    min_balancedness_to_skip: float = 0.95
    rebalance_below_balancedness: float = 0.0
    use_async: bool = False
    migration_method: str = "p2p"
    trigger: str | None = None
    check_interval: int = 16
    full_check_interval: int = 64
    step_seconds: float = 60.0 / 8192
    transfer_bytes_per_s: float = LINK_BYTES_PER_S
    move_margin: float = 1.5

    def __post_init__(self) -> None:
        if self.migration_method not in MIGRATION_METHODS:
            raise ValueError(f"migration_method {self.migration_method!r} is not one of {MIGRATION_METHODS}")
        if self.policy not in POLICIES and self.policy not in _POLICY_ALIASES:
            raise ValueError(f"policy {self.policy!r} is not one of {POLICIES + tuple(_POLICY_ALIASES)}")
        if self.trigger is not None and self.trigger not in TRIGGERS:
            raise ValueError(f"trigger {self.trigger!r} is not one of {TRIGGERS}")
        for name in ("num_redundant_experts", "window_size", "step_interval", "check_interval",
                     "full_check_interval"):
            value = getattr(self, name)
            if name == "step_interval" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts={self.num_redundant_experts} must be >= 0")
        if self.window_size <= 0:
            raise ValueError(f"window_size={self.window_size} must be > 0")
        if self.step_interval is not None and self.step_interval <= 0:
            raise ValueError(f"step_interval={self.step_interval} must be > 0")
        if self.check_interval <= 0 or self.full_check_interval <= 0:
            raise ValueError(f"check_interval={self.check_interval} and full_check_interval="
                             f"{self.full_check_interval} must be > 0")
        if not self.step_seconds >= 0 or not self.move_margin >= 0 or not self.transfer_bytes_per_s > 0:
            raise ValueError(f"step_seconds={self.step_seconds} and move_margin={self.move_margin} must be >= 0, "
                             f"transfer_bytes_per_s={self.transfer_bytes_per_s} > 0")
        for name in ("min_balancedness_to_skip", "rebalance_below_balancedness"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}={value} must be within [0, 1]")

    @property
    def resolved_trigger(self) -> str:
        """"forecast" or "interval" (see trigger)."""
        if self.trigger is not None:
            return self.trigger
        return "interval" if self.step_interval is not None else "forecast"

    @property
    def resolved_step_interval(self) -> int:
        """step_interval, or vLLM's default 3000 when not given."""
        return 3000 if self.step_interval is None else self.step_interval

    @property
    def resolved_policy(self) -> str:
        """The policy name rebalance_experts takes."""
        return _POLICY_ALIASES.get(self.policy, self.policy)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BalancerConfig:
        """Strict: an unknown key raises ValueError naming it (vLLM eplb-config keys accepted)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown balancer config key(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    def num_physical_experts(self, num_experts: int) -> int:
        return num_experts + self.num_redundant_experts

    def validate_for(self, num_experts: int, ep_size: int) -> None:
        """Raise ValueError, with the numbers, when this config cannot place num_experts on ep_size ranks."""
        if num_experts <= 0 or ep_size <= 0:
            raise ValueError(f"num_experts={num_experts} and ep_size={ep_size} must be positive")
        slots = self.num_physical_experts(num_experts)
        if slots % ep_size:
            raise ValueError(
                f"num_experts={num_experts} + num_redundant_experts={self.num_redundant_experts} = {slots} "
                f"slots is not divisible by ep_size={ep_size}")
        if self.num_redundant_experts and not self.enable_eplb:
            raise ValueError(f"num_redundant_experts={self.num_redundant_experts} needs enable_eplb=True")


@dataclass(frozen=True)
class RebalanceDecision:
    """Truthy when the runtime should rebalance now; reason says why (or why not)."""

    rebalance: bool
    reason: str
    balancedness: float

    def __bool__(self) -> bool:
        return self.rebalance


def should_rebalance(step: int, stats: RoutingStats, config: BalancerConfig) -> RebalanceDecision:
    """Decide on the driver from the all-reduced window (so every rank agrees).

    Due every step_interval steps (step > 0), skipped when balancedness is already
    >= min_balancedness_to_skip; early when a full window is below
    rebalance_below_balancedness.
    """
    if not config.enable_eplb:
        return RebalanceDecision(False, "eplb disabled", 1.0)
    if stats.num_steps == 0:
        return RebalanceDecision(False, "no statistics recorded", 1.0)
    _, balancedness = stats.balancedness()
    interval = config.resolved_step_interval
    if step > 0 and step % interval == 0:
        if balancedness >= config.min_balancedness_to_skip:
            return RebalanceDecision(False, f"due, skipped: balancedness {balancedness:.4f} >= "
                                     f"{config.min_balancedness_to_skip}", balancedness)
        return RebalanceDecision(True, f"step_interval {interval} reached", balancedness)
    if stats.is_full and balancedness < config.rebalance_below_balancedness:
        return RebalanceDecision(True, f"balancedness {balancedness:.4f} < "
                                 f"{config.rebalance_below_balancedness}", balancedness)
    return RebalanceDecision(False, "not due", balancedness)
