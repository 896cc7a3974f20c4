"""Expert load -> rows per EP rank, through the balancer's placement.

The routed-expert GEMMs of a step wait for the busiest EP rank, so the cost model needs
each rank's share of the routed rows per layer. It takes a measured load (tokens per
logical expert and layer, e.g. summed from an expert-distribution dump) or a synthetic
Zipf-skewed one, places it exactly as the runtime would (identity when EPLB is off,
``balancer.policy.rebalance_experts`` when on, or a given ``phy2log``), and splits each
expert's load equally among its replicas (``balancer.balancedness``).

Shape letters: L MoE layers, E logical experts, P physical slots, R EP ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from balancer.balancedness import rank_load_of_slots, slot_load_of_experts
from balancer.policy import rebalance_experts


def synthetic_expert_load(num_layers: int, num_experts: int, skew: float = 0.0, seed: int = 0) -> np.ndarray:
    """[L, E] float64, each row sums to 1: expert j of a random per-layer order gets a share
    proportional to (j + 1) ** -skew (skew 0: uniform; ~1: a few hot experts)."""
    if num_layers < 1 or num_experts < 1:
        raise ValueError(f"need num_layers >= 1 and num_experts >= 1, got {num_layers}, {num_experts}")
    if skew < 0:
        raise ValueError(f"skew must be >= 0, got {skew}")
    rng = np.random.default_rng(seed)
    base = (np.arange(num_experts, dtype=np.float64) + 1.0) ** -skew
    load = np.stack([base[rng.permutation(num_experts)] for _ in range(num_layers)])
    return load / load.sum(1, keepdims=True)


@dataclass(frozen=True)
class RankLoad:
    """Where one step's routed rows land.

    slot_share: [L, P] fraction of a layer's routed rows per physical slot (rows sum to 1).
    rank_share: [L, R] the same per EP rank. phy2log: [L, P] the placement used.
    balancedness: sum over layers of mean rank load / sum of max rank load (1.0 = perfect).
    """

    slot_share: np.ndarray
    rank_share: np.ndarray
    phy2log: np.ndarray
    balancedness: float

    @property
    def num_ranks(self) -> int:
        return int(self.rank_share.shape[1])

    @property
    def slots_per_rank(self) -> int:
        return self.slot_share.shape[1] // self.num_ranks


def compute_rank_load(load: np.ndarray, num_slots: int, num_ranks: int, *, enable_eplb: bool,
                      num_groups: int = 1, num_nodes: int = 1, policy: str = "auto",
                      placement: np.ndarray | None = None) -> RankLoad:
    """Place ``load`` [L, E] on ``num_slots`` slots over ``num_ranks`` EP ranks.

    placement: [L, P] phy2log to use as is; else EPLB's placement of this load when
    enable_eplb, else the identity (slot p holds expert p % E)."""
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 2 or (load < 0).any() or load.sum() <= 0:
        raise ValueError(f"expert load must be a non-negative [L, E] array with some load, got shape {load.shape}")
    num_layers, num_experts = load.shape
    if placement is not None:
        phy2log = np.asarray(placement, dtype=np.int64)
        if phy2log.shape != (num_layers, num_slots):
            raise ValueError(f"placement has shape {phy2log.shape}, expected [L, P] = {(num_layers, num_slots)}")
    elif enable_eplb and num_ranks > 1:
        groups = num_groups if num_experts % num_groups == 0 else 1
        nodes = num_nodes if num_ranks % num_nodes == 0 else 1
        phy2log = rebalance_experts(load, num_slots, groups, nodes, num_ranks, policy=policy)[0].numpy()
    else:
        phy2log = np.tile(np.arange(num_slots) % num_experts, (num_layers, 1))
    share = load / load.sum(1, keepdims=True)
    slots = slot_load_of_experts(share, phy2log)
    ranks = rank_load_of_slots(slots, num_ranks)
    balancedness = float(ranks.mean(1).sum() / ranks.max(1).sum())
    return RankLoad(slot_share=slots, rank_share=ranks, phy2log=phy2log, balancedness=balancedness)


def busiest_rank_rows(rank_load: RankLoad, total_rows: float, capacity_rows: float | None = None
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per layer, the busiest EP rank's routed rows, touched slots and dropped rows.

    total_rows: routed rows of the whole EP group in one step (tokens x top-k).
    capacity_rows: per-slot cap C (None: dropless). A slot of expected n rows is touched
    with probability 1 - (1 - share)^total_rows (small decode batches leave experts idle).
    Returns rows [L], touched [L] (expected slots with work), dropped [L] (over all slots)."""
    slot_rows = rank_load.slot_share * total_rows
    dropped = np.zeros(slot_rows.shape[0])
    if capacity_rows is not None:
        kept = np.minimum(slot_rows, capacity_rows)
        dropped = (slot_rows - kept).sum(1)
        slot_rows = kept
    r, per = rank_load.num_ranks, rank_load.slots_per_rank
    rows = slot_rows.reshape(slot_rows.shape[0], r, per).sum(-1)
    touched = (1.0 - (1.0 - rank_load.slot_share) ** max(total_rows, 0.0)).reshape(slot_rows.shape[0], r, per).sum(-1)
    busiest = rows.argmax(1)
    idx = np.arange(rows.shape[0])
    return rows[idx, busiest], touched[idx, busiest], dropped
