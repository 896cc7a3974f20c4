"""Capacity-factor enforcement: how many (token, slot) assignments each slot may take.

Shape legend: T tokens, K top-k, P physical slots (``num_slots``), R source ranks.

Capacity per slot (DeepSpeed / GShard): ``C = max(min_capacity, ceil(T / P * cf * K))``,
computed exactly as DeepSpeed's ``_capacity`` does (a float32 product of ``T / P`` and
``cf * K``) so the two agree on boundary cases; ``cf <= 0`` means dropless (no limit).

Which assignments of an over-full slot survive (``policy``):

- ``"position"``: token order (then k), DeepSpeed ``drop_policy="position"``;
- ``"score"``: highest router weight first (ties by position), DeepSpeed ``"probs"``.

What happens to the others (``overflow``): ``"drop"`` removes the assignment (slot id
-1, weight 0); ``"reroute"`` moves it, keeping its weight, to the token's best-scoring
slot (by ``router_scores``) that is not already one of its slots and still has room;
if none has room it is dropped. With ``renormalize`` the surviving weights of every
token are rescaled to sum to one, DeepSpeed style (``w / max(sum_kept w, eps)``; a
token with nothing kept gets all-zero weights).

Scopes: the MoE layer applies ``apply_capacity`` per source rank before dispatch
("local", no collective); the AllToAll dispatcher enforces a "global" cap across the
EP group with ``compute_global_limits`` + ``apply_slot_limits`` after its count exchange.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

POLICIES = ("position", "score")
OVERFLOWS = ("drop", "reroute")
SCOPES = ("local", "global")


@dataclass(frozen=True)
class CapacityConfig:
    """How capacity is enforced; carried typed from the runtime config to every MoE layer.

    capacity_factor: cf; <= 0 means dropless (the default: every other field is then inert).
    scope: "local" (each source rank caps its own tokens before dispatch, no collective) or
    "global" (the dispatcher caps the EP group's tokens after its count exchange).
    policy / overflow / min_capacity / renormalize: as ``apply_capacity`` takes them.
    The global scope shares each slot's C between ranks in rank order, then token order: it
    supports policy "position" with overflow "drop" only (a score order or a reroute would
    need every rank's scores); other combinations raise here, naming them.
    """

    capacity_factor: float = 0.0
    scope: str = "local"
    policy: str = "position"
    overflow: str = "drop"
    min_capacity: int = 0
    renormalize: bool = False

    def __post_init__(self) -> None:
        for name, value, choices in (("scope", self.scope, SCOPES), ("policy", self.policy, POLICIES),
                                     ("overflow", self.overflow, OVERFLOWS)):
            if value not in choices:
                raise ValueError(f"capacity_{name} must be one of {choices}, got {value!r}")
        if not math.isfinite(self.capacity_factor):  # nan compares false: it would pass as dropless
            raise ValueError(f"capacity_factor must be a finite number (<= 0: dropless), got {self.capacity_factor}")
        if self.min_capacity < 0:
            raise ValueError(f"min_capacity must be >= 0, got {self.min_capacity}")
        if self.enabled and self.scope == "global" and (self.policy, self.overflow) != ("position", "drop"):
            raise ValueError(
                f"capacity_scope 'global' supports capacity_policy 'position' with capacity_overflow 'drop' only, "
                f"got policy {self.policy!r} with overflow {self.overflow!r}: use capacity_scope 'local'")

    @property
    def enabled(self) -> bool:
        return self.capacity_factor > 0

    @property
    def drops_in_token_order(self) -> bool:
        """Policy "position", overflow "drop", no renormalisation: what ``moe.kernels.capacity_drop``
        (and the fused MoE op) enforce on CPU in one pass."""
        return self.policy == "position" and self.overflow == "drop" and not self.renormalize

    def capacity_for(self, num_tokens: int, num_slots: int, top_k: int) -> int | None:
        """C for one layer call of ``num_tokens`` rows (``compute_capacity``; remembered per shape:
        a decode step asks with the same T every layer)."""
        return _capacity_cached(num_tokens, num_slots, top_k, self.capacity_factor, self.min_capacity)

    @property
    def is_local(self) -> bool:
        """Enforced by each MoE layer before dispatch."""
        return self.enabled and self.scope == "local"

    @property
    def is_global(self) -> bool:
        """Enforced by the EP dispatcher over the whole group."""
        return self.enabled and self.scope == "global"


@dataclass(frozen=True)
class CapacityStats:
    """Per-layer, per-step totals (what the worker reports).

    assignments: valid (token, slot) assignments before capacity; dropped: removed;
    rerouted: moved to another slot; max_slot_load: assignments the fullest slot
    processes after capacity; capacity: C, or None when dropless.
    """

    assignments: int
    dropped: int
    rerouted: int
    max_slot_load: int
    capacity: int | None

    @property
    def drop_rate(self) -> float:
        return self.dropped / self.assignments if self.assignments else 0.0


@dataclass(frozen=True)
class CapacityResult:
    """Outcome of capacity enforcement.

    kept: [T, K] bool, assignment survives (at its slot or a rerouted one);
    topk_ids: [T, K] int64 slots after capacity, -1 where dropped;
    topk_weights: [T, K] float32, 0 where dropped (renormalised if asked);
    slot_assignments: [P] int64 assignments requested per slot (before capacity);
    slot_load: [P] int64 assignments per slot after capacity (rerouted ones count at
    their new slot); slot_dropped / slot_rerouted: [P] int64 by originally requested slot.
    """

    kept: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    capacity: int | None
    slot_assignments: torch.Tensor
    slot_load: torch.Tensor
    slot_dropped: torch.Tensor
    slot_rerouted: torch.Tensor

    @property
    def stats(self) -> CapacityStats:
        return CapacityStats(
            assignments=int(self.slot_assignments.sum()),
            dropped=int(self.slot_dropped.sum()),
            rerouted=int(self.slot_rerouted.sum()),
            max_slot_load=int(self.slot_load.max()) if self.slot_load.numel() else 0,
            capacity=self.capacity,
        )


def compute_capacity(
    num_tokens: int, num_slots: int, top_k: int, capacity_factor: float, min_capacity: int = 0
) -> int | None:
    """C = max(min_capacity, ceil(num_tokens / num_slots * capacity_factor * top_k)); None if cf <= 0.

    The product is taken in float32 exactly as DeepSpeed's ``_capacity`` does.
    """
    if num_slots < 1 or top_k < 1 or num_tokens < 0 or min_capacity < 0:
        raise ValueError(
            f"capacity needs num_slots >= 1, top_k >= 1, num_tokens >= 0, min_capacity >= 0; got "
            f"num_slots={num_slots}, top_k={top_k}, num_tokens={num_tokens}, min_capacity={min_capacity}"
        )
    if capacity_factor <= 0:
        return None
    cap = torch.ceil((num_tokens / num_slots) * torch.tensor(capacity_factor * top_k)).to(torch.int64)
    return max(int(cap), int(min_capacity))


@functools.lru_cache(maxsize=1024)
def _capacity_cached(num_tokens: int, num_slots: int, top_k: int, capacity_factor: float, min_capacity: int
                     ) -> int | None:
    return compute_capacity(num_tokens, num_slots, top_k, capacity_factor, min_capacity)


def compute_slot_positions(
    topk_ids: torch.Tensor, num_slots: int, priority: torch.Tensor | None = None
) -> torch.Tensor:
    """Rank of every assignment inside its slot.

    topk_ids: [T, K] int64 (< 0 ignored); priority: optional [T, K] float, higher first
    (ties and the default use token order, then k). Returns: [T, K] int64, 0 for the
    first assignment a slot sees, -1 where topk_ids < 0.
    """
    flat = topk_ids.reshape(-1)
    valid = torch.nonzero(flat >= 0, as_tuple=False).squeeze(1)  # position order
    if priority is not None:
        by_score = torch.argsort(-priority.reshape(-1)[valid].float(), stable=True)
        valid = valid[by_score]
    slots = flat[valid]
    perm = torch.argsort(slots, stable=True)
    sorted_slots = slots[perm]
    counts = torch.bincount(sorted_slots, minlength=num_slots)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.full_like(flat, -1)
    pos[valid[perm]] = torch.arange(sorted_slots.numel(), dtype=torch.int64, device=flat.device) - starts[sorted_slots]
    return pos.reshape(topk_ids.shape)


def compute_global_limits(slot_counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """Share each slot's capacity between source ranks, lowest rank first.

    slot_counts: [R, P] int64 assignments each source rank sends to each slot.
    Returns: [R, P] int64 how many of them each slot accepts (rank r gets what the
    ranks before it left over, at most its own count).
    """
    before = torch.cumsum(slot_counts, 0) - slot_counts
    return torch.clamp(capacity - before, min=0).minimum(slot_counts)


def apply_slot_limits(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    limits: torch.Tensor,
    *,
    renormalize: bool = False,
    capacity: int | None = None,
) -> CapacityResult:
    """Keep the first ``limits[p]`` assignments of each slot p in token order; drop the rest.

    topk_ids: [T, K] int64 (-1 = already dropped); topk_weights: [T, K]; limits: [P] int64.
    ``capacity`` is only recorded in the result (the C the limits derive from).
    """
    num_slots = int(limits.numel())
    _check_inputs(topk_ids, topk_weights, num_slots)
    pos = compute_slot_positions(topk_ids, num_slots)
    valid = topk_ids >= 0
    kept = valid & (pos < limits[topk_ids.clamp(min=0)])
    return _finish(topk_ids, topk_weights, valid, kept, topk_ids, capacity, num_slots, renormalize)


def apply_capacity(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_slots: int,
    capacity_factor: float,
    *,
    min_capacity: int = 0,
    policy: str = "position",
    overflow: str = "drop",
    renormalize: bool = False,
    router_scores: torch.Tensor | None = None,
) -> CapacityResult:
    """Enforce C assignments per slot on one rank's routed tokens.

    topk_ids: [T, K] int64 slots in [0, num_slots) (-1 = already dropped);
    topk_weights: [T, K] float; router_scores: [T, num_slots] float, needed for
    ``overflow="reroute"`` (-inf marks slots a token may not use).
    Returns a ``CapacityResult``; ``capacity_factor <= 0`` keeps everything.
    """
    if policy not in POLICIES:
        raise ValueError(f"capacity policy must be one of {POLICIES}, got {policy!r}")
    if overflow not in OVERFLOWS:
        raise ValueError(f"capacity overflow must be one of {OVERFLOWS}, got {overflow!r}")
    _check_inputs(topk_ids, topk_weights, num_slots)
    num_tokens, top_k = topk_ids.shape
    capacity = compute_capacity(num_tokens, num_slots, max(top_k, 1), capacity_factor, min_capacity)
    valid = topk_ids >= 0
    if capacity is None:
        return _finish(topk_ids, topk_weights, valid, valid, topk_ids, None, num_slots, renormalize)
    priority = topk_weights if policy == "score" else None
    pos = compute_slot_positions(topk_ids, num_slots, priority)
    kept = valid & (pos < capacity)
    new_ids = topk_ids
    if overflow == "reroute":
        if router_scores is None or tuple(router_scores.shape) != (num_tokens, num_slots):
            got = None if router_scores is None else tuple(router_scores.shape)
            raise ValueError(f"overflow='reroute' needs router_scores [T, P] = [{num_tokens}, {num_slots}], got {got}")
        new_ids = _reroute(topk_ids, kept, valid, capacity, router_scores, priority, num_slots)
        kept = new_ids >= 0
    return _finish(topk_ids, topk_weights, valid, kept, new_ids, capacity, num_slots, renormalize)


def _check_inputs(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_slots: int) -> None:
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, K], got shape {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights shape {tuple(topk_weights.shape)} differs from topk_ids {tuple(topk_ids.shape)}"
        )
    if topk_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"topk_ids must be int64 or int32, got {topk_ids.dtype}")
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    if topk_ids.numel() and int(topk_ids.max()) >= num_slots:
        raise ValueError(f"slot id {int(topk_ids.max())} out of range for num_slots={num_slots}")


def _reroute(
    topk_ids: torch.Tensor,
    kept: torch.Tensor,
    valid: torch.Tensor,
    capacity: int,
    router_scores: torch.Tensor,
    priority: torch.Tensor | None,
    num_slots: int,
) -> torch.Tensor:
    """Greedy second chances, in policy order: each overflowed assignment takes the
    best-scoring slot its token does not use yet that is below capacity.
    Returns: [T, K] int64 ids (moved ones changed, unplaceable ones -1). Runs on the CPU
    (a sequential greedy); the result goes back to the input's device."""
    device = topk_ids.device
    topk_ids, kept, valid = topk_ids.cpu(), kept.cpu(), valid.cpu()
    priority = None if priority is None else priority.cpu()
    ids = topk_ids.to(torch.int64).clone()
    ids[valid & ~kept] = -1
    over = torch.nonzero((valid & ~kept).reshape(-1), as_tuple=False).squeeze(1)
    if over.numel() == 0:
        return ids.to(device)
    if priority is not None:
        over = over[torch.argsort(-priority.reshape(-1)[over].float(), stable=True)]
    top_k = topk_ids.shape[1]
    load = np.bincount(ids[ids >= 0].numpy(), minlength=num_slots)
    scores = router_scores.detach().float().cpu().numpy()
    taken = np.zeros((topk_ids.shape[0], num_slots), dtype=bool)
    rows, cols = np.nonzero(valid.numpy())
    taken[rows, topk_ids.numpy()[rows, cols]] = True
    ids_np = ids.numpy()
    for flat in over.tolist():
        t, k = divmod(flat, top_k)
        ok = ~taken[t] & (load < capacity) & (scores[t] > -np.inf)
        if not ok.any():
            continue
        cand = np.flatnonzero(ok)
        best = int(cand[np.argmax(scores[t, cand])])  # argmax: first of equal scores
        ids_np[t, k] = best
        taken[t, best] = True
        load[best] += 1
    return torch.from_numpy(ids_np).to(device)


def _finish(
    orig_ids: torch.Tensor,
    weights: torch.Tensor,
    valid: torch.Tensor,
    kept: torch.Tensor,
    new_ids: torch.Tensor,
    capacity: int | None,
    num_slots: int,
    renormalize: bool,
) -> CapacityResult:
    orig = orig_ids.to(torch.int64)
    ids = torch.where(kept, new_ids.to(torch.int64), torch.full_like(orig, -1))
    w = torch.where(kept, weights.float(), 0.0)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).eps)
    moved = kept & (ids != orig)
    dropped = valid & ~kept

    def per_slot(mask: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        return torch.bincount(slot_ids[mask], minlength=num_slots).to(torch.int64)

    return CapacityResult(
        kept=kept,
        topk_ids=ids,
        topk_weights=w,
        capacity=capacity,
        slot_assignments=per_slot(valid, orig),
        slot_load=per_slot(kept, ids),
        slot_dropped=per_slot(dropped, orig),
        slot_rerouted=per_slot(moved, orig),
    )
