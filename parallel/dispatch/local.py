"""One EP rank hosting every slot, with an optional "global" capacity (which on one
rank is just capacity over this rank's tokens)."""

from __future__ import annotations

import torch

from moe.capacity import CapacityConfig, CapacityStats, apply_capacity
from moe.dispatch import ExpertDispatcher, LocalDispatcher
from moe.experts import Experts
from parallel.dispatch.global_capacity import check_global
from parallel.dispatch.plan import check_dispatch_args


class CappedLocalDispatcher:
    """ExpertDispatcher without communication that enforces ``global_capacity`` in token order."""

    rank = 0
    num_ranks = 1

    def __init__(self, global_capacity: CapacityConfig, inner: ExpertDispatcher | None = None,
                 report_stats: bool = True) -> None:
        """inner: where the capped assignments go (None: a ``LocalDispatcher``, this rank's experts). With tp > 1 and
        one EP rank it is the ``TensorParallelSplit`` of a ``LocalDispatcher``: every TP rank holds
        the whole batch, so capacity is applied to all of it here, in token order, as one process
        applies it, before the rows are shared out (capping each TP rank's share changed C and the
        order). report_stats: keep ``capacity_stats`` (False on every TP rank but the first: they
        all cap the same batch, and the driver sums what the ranks report)."""
        check_global(global_capacity)
        self.global_capacity = global_capacity
        self.inner = inner if inner is not None else LocalDispatcher()
        self.report_stats = report_stats
        self.capacity_stats: dict[int, CapacityStats] = {}

    def dispatch_combine(
        self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, experts: Experts, layer_id: int
    ) -> torch.Tensor:
        """x: [T, D]; slot_ids/weights: [T, K]. Returns [T, D] float32."""
        check_dispatch_args(x, slot_ids, weights, experts.hidden_size)
        cfg = self.global_capacity
        result = apply_capacity(slot_ids, weights, experts.num_local_slots, cfg.capacity_factor,
                                min_capacity=cfg.min_capacity, renormalize=cfg.renormalize)
        if self.report_stats:
            self.capacity_stats[layer_id] = result.stats
        return self.inner.dispatch_combine(x, result.topk_ids, result.topk_weights, experts, layer_id)
