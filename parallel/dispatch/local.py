"""One EP rank hosting every slot, with an optional "global" capacity (which on one
rank is just capacity over this rank's tokens)."""

from __future__ import annotations

import torch

from moe.capacity import CapacityConfig, CapacityStats, apply_capacity
from moe.experts import Experts
from parallel.dispatch.global_capacity import check_global
from parallel.dispatch.plan import check_dispatch_args


class CappedLocalDispatcher:
    """ExpertDispatcher without communication that enforces ``global_capacity`` in token order."""

    rank = 0
    num_ranks = 1

    def __init__(self, global_capacity: CapacityConfig) -> None:
        check_global(global_capacity)
        self.global_capacity = global_capacity
        self.capacity_stats: dict[int, CapacityStats] = {}

    def dispatch_combine(
        self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, experts: Experts, layer_id: int
    ) -> torch.Tensor:
        """x: [T, D]; slot_ids/weights: [T, K]. Returns [T, D] float32."""
        check_dispatch_args(x, slot_ids, weights, experts.hidden_size)
        cfg = self.global_capacity
        result = apply_capacity(slot_ids, weights, experts.num_local_slots, cfg.capacity_factor,
                                min_capacity=cfg.min_capacity, renormalize=cfg.renormalize)
        self.capacity_stats[layer_id] = result.stats
        return experts(x, result.topk_ids, result.topk_weights)
