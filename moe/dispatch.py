"""How routed tokens reach the experts: the dispatcher interface and the local one.

Shape legend: T tokens on this rank, D hidden, K top-k.
"""

from __future__ import annotations

from typing import Protocol

import torch

from moe.experts import Experts


class ExpertDispatcher(Protocol):
    """Moves each (token, slot) assignment to the rank hosting the slot and back.

    Every EP rank must call ``dispatch_combine`` for every MoE layer of every step,
    even with T = 0: it is a collective.
    """

    rank: int
    num_ranks: int

    def dispatch_combine(
        self,
        x: torch.Tensor,
        slot_ids: torch.Tensor,
        weights: torch.Tensor,
        experts: Experts,
        layer_id: int,
    ) -> torch.Tensor:
        """x: [T, D]; slot_ids: [T, K] int64 physical slots, -1 = dropped; weights: [T, K]
        float32. Returns: [T, D] float32, sum over kept k of weights * expert(x)."""
        ...


class LocalDispatcher:
    """One rank hosts every physical slot: no communication."""

    rank = 0
    num_ranks = 1

    def dispatch_combine(
        self,
        x: torch.Tensor,
        slot_ids: torch.Tensor,
        weights: torch.Tensor,
        experts: Experts,
        layer_id: int,
    ) -> torch.Tensor:
        return experts(x, slot_ids, weights)
