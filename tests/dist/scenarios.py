"""Deterministic MoE-hop scenarios shared by the spawned ranks and the single-process oracle.

Every rank regenerates the whole (all DP ranks) input from the scenario's seed and keeps
its own slice, so the parent test can rebuild exactly what each rank saw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe.capacity import apply_capacity
from moe.experts import Experts


@dataclass(frozen=True)
class Scenario:
    """tokens: T per DP rank; phy2log: logical expert of each physical slot (replicas
    allowed); unused_slots: never routed to (experts receiving no tokens); capacity:
    "none" | "local" (per source DP rank) | "global" (over the EP group)."""

    name: str
    tp: int
    dp: int
    backend: str
    tokens: tuple[int, ...]
    phy2log: tuple[int, ...]
    top_k: int = 2
    hidden: int = 10
    inter: int = 6
    dtype: torch.dtype = torch.float32
    ep: int | None = None
    unused_slots: tuple[int, ...] = ()
    drop_prob: float = 0.1
    capacity: str = "none"
    capacity_factor: float = 0.0
    renormalize: bool = False
    seed: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def num_slots(self) -> int:
        return len(self.phy2log)


def expert_weights(s: Scenario) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot weights: w13 [P, 2I, D], w2 [P, D, I]; replicas of one logical expert are identical."""
    gen = torch.Generator().manual_seed(1000 + s.seed)
    num_logical = max(s.phy2log) + 1
    w13 = torch.randn(num_logical, 2 * s.inter, s.hidden, generator=gen) * 0.3
    w2 = torch.randn(num_logical, s.hidden, s.inter, generator=gen) * 0.3
    idx = torch.tensor(s.phy2log)
    return w13[idx].to(s.dtype), w2[idx].to(s.dtype)


def dp_inputs(s: Scenario) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per DP rank: (x [T, D], slot_ids [T, K] int64 with some -1, weights [T, K] float32)."""
    gen = torch.Generator().manual_seed(s.seed)
    usable = torch.tensor([p for p in range(s.num_slots) if p not in s.unused_slots])
    out = []
    for n in s.tokens:
        x = torch.randn(n, s.hidden, generator=gen).to(s.dtype)
        picks = torch.stack([torch.randperm(usable.numel(), generator=gen)[: s.top_k] for _ in range(n)]) \
            if n else torch.empty(0, s.top_k, dtype=torch.int64)
        ids = usable[picks] if n else picks
        drop = torch.rand(n, s.top_k, generator=gen) < s.drop_prob
        ids = torch.where(drop, torch.full_like(ids, -1), ids)
        w = torch.rand(n, s.top_k, generator=gen)
        out.append((x, ids, w))
    return out


def apply_local_capacity(s: Scenario, ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the MoE layer does with scope "local": capacity over one DP rank's tokens."""
    res = apply_capacity(ids, w, s.num_slots, s.capacity_factor, renormalize=s.renormalize)
    return res.topk_ids, res.topk_weights


def build_experts(s: Scenario, slots: range) -> Experts:
    w13, w2 = expert_weights(s)
    experts = Experts(len(slots), s.hidden, s.inter, torch.tensor(list(slots)), dtype=s.dtype)
    experts.w13.data.copy_(w13[slots.start : slots.stop])
    experts.w2.data.copy_(w2[slots.start : slots.stop])
    return experts


def oracle(s: Scenario) -> tuple[list[torch.Tensor], object]:
    """Single-process outputs per DP rank ([T, D] float32) and, for global capacity, the
    CapacityStats of the whole batch."""
    experts = build_experts(s, range(s.num_slots))
    inputs = dp_inputs(s)
    stats = None
    if s.capacity == "local":
        inputs = [(x, *apply_local_capacity(s, ids, w)) for x, ids, w in inputs]
    elif s.capacity == "global":
        res = apply_capacity(torch.cat([i[1] for i in inputs]), torch.cat([i[2] for i in inputs]),
                             s.num_slots, s.capacity_factor, renormalize=s.renormalize)
        stats = res.stats
        sizes = list(s.tokens)
        inputs = [(x, ids, w) for (x, _, _), ids, w in
                  zip(inputs, res.topk_ids.split(sizes), res.topk_weights.split(sizes))]
    return [experts(x, ids, w) for x, ids, w in inputs], stats
