"""The balancing side of the driver: statistics window, trigger, rebalance, distribution record.

Decide once here, broadcast the same move plan to every worker, switch together.
Shape legend: L MoE layers, E logical experts, P physical slots, R EP ranks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from balancer import (
    BalancerConfig,
    Placement,
    RoutingStats,
    compute_move_plan,
    predict,
    rebalance_experts,
    should_rebalance,
)

log = logging.getLogger(__name__)


@dataclass
class BalancerCounters:
    num_rebalances: int = 0
    rebalance_seconds_total: float = 0.0
    expert_copies_moved: int = 0
    bytes_moved: int = 0


class EplbDriver:
    """Owns the placement in force and the routing-statistics window (driver side)."""

    def __init__(self, config: BalancerConfig, placement: Placement, *, num_groups: int, num_nodes: int,
                 expert_bytes: int) -> None:
        self.config = config
        self.placement = placement
        self.num_groups = num_groups
        self.num_nodes = num_nodes
        self.expert_bytes = expert_bytes
        self.stats = RoutingStats(placement.num_layers, placement.num_physical, placement.num_gpus,
                                  config.window_size)
        self.counters = BalancerCounters()
        self.step = 0
        self.last_balancedness: list[float] = [1.0] * placement.num_layers
        # Each recorded step: (logical [L, E], physical [L, P], dropped [L] or None).
        self._recording: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] | None = None
        self._recorded: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    # ---- statistics ------------------------------------------------------------------

    def record(self, slot_load: torch.Tensor, dropped: torch.Tensor | None = None) -> None:
        """slot_load: [L, P] int64 assignments per slot this step, summed over DP ranks;
        dropped: [L] int64 assignments dropped by expert capacity this step (None: dropless)."""
        self.step += 1
        self.stats.record(slot_load)
        if self._recording is not None:
            physical = slot_load.to(torch.int64).cpu()
            logical = torch.zeros(self.placement.num_layers, self.placement.num_logical, dtype=torch.int64)
            logical.scatter_add_(1, self.placement.phy2log, physical)
            self._recording.append((logical, physical, None if dropped is None else dropped.to(torch.int64)))
        if self.config.log_balancedness and self.step % 10 == 0:
            per_layer, overall = self.stats.balancedness()
            log.info("eplb step %d: balancedness %.4f (worst layer %.4f)", self.step, overall, float(per_layer.min()))

    def balancedness(self) -> tuple[list[float], float]:
        """(per layer [L], overall) over the window; 1.0 with no data."""
        if self.stats.num_steps == 0:
            return [1.0] * self.placement.num_layers, 1.0
        per_layer, overall = self.stats.balancedness()
        return [float(x) for x in per_layer], float(overall)

    # ---- rebalancing -----------------------------------------------------------------

    def due(self) -> bool:
        return bool(should_rebalance(self.step, self.stats, self.config))

    def plan_rebalance(self):
        """Compute (new Placement, MovePlan, predicted balancedness) from the window."""
        load = self.stats.logical_load(self.placement.phy2log)  # [L, E]
        phy2log, _, _ = rebalance_experts(
            load, self.placement.num_physical, self.num_groups, self.num_nodes, self.placement.num_gpus,
            old_phy2log=self.placement.phy2log, policy=self.config.resolved_policy,
        )
        new = Placement.from_phy2log(phy2log, self.placement.num_logical, self.placement.num_gpus)
        plan = compute_move_plan(self.placement.phy2log, new.phy2log, new.num_gpus,
                                 new.num_gpus // self.num_nodes, self.expert_bytes)
        return new, plan, predict(load, new.phy2log, new.num_gpus)

    def commit(self, new: Placement, plan, seconds: float) -> None:
        self.placement = new
        self.stats.reset()
        self.counters.num_rebalances += 1
        self.counters.rebalance_seconds_total += seconds
        self.counters.expert_copies_moved += plan.num_copies_moved
        self.counters.bytes_moved += plan.total_bytes

    # ---- SGLang-style expert distribution record --------------------------------------

    def start_record(self) -> None:
        self._recording = []

    def stop_record(self) -> None:
        if self._recording is not None:
            self._recorded.extend(self._recording)
        self._recording = None

    def dump_record(self, directory: str | Path, metadata: dict[str, str] | None = None) -> Path:
        """Write the record (safetensors): logical_count [steps, L, E] and physical_count
        [steps, L, P] int64 (per slot, under the placement in force at each step), dropped_count
        [steps, L] when expert capacity was on, plus the placement in force now (phy2log,
        log2phy, logcnt, num_gpus). ``metadata``: extra string entries (e.g. workload phases)."""
        from safetensors.torch import save_file

        steps = list(self._recorded) + list(self._recording or [])
        p = self.placement
        if steps:
            count = torch.stack([s[0] for s in steps])
            physical = torch.stack([s[1] for s in steps])
        else:
            count = torch.zeros(0, p.num_layers, p.num_logical, dtype=torch.int64)
            physical = torch.zeros(0, p.num_layers, p.num_physical, dtype=torch.int64)
        tensors = {"logical_count": count.contiguous(), "physical_count": physical.contiguous(),
                   **{k: v.contiguous() for k, v in p.state_dict().items()}}
        if any(s[2] is not None for s in steps):
            tensors["dropped_count"] = torch.stack([
                s[2] if s[2] is not None else torch.zeros(p.num_layers, dtype=torch.int64) for s in steps])
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"expert_distribution_{time.strftime('%Y%m%d-%H%M%S')}_{len(steps)}steps.safetensors"
        save_file(tensors, str(path), metadata={"format": "moe-serve expert distribution v1", **(metadata or {})})
        self._recorded = []
        return path
