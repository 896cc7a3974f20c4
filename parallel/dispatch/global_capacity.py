"""Capacity enforced across the whole EP group ("global" scope).

Every source rank contributes its per-slot assignment counts and token count; the
slot's capacity C = f(total tokens of the EP group) is shared out in source-rank order,
then token order inside a rank (``moe.capacity.compute_global_limits``). The result is
exactly ``apply_capacity(policy="position", overflow="drop")`` on the concatenation of
every rank's tokens in EP-rank order, without moving any token twice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe import kernels
from moe.capacity import (
    CapacityConfig,
    CapacityStats,
    apply_slot_limits,
    compute_capacity,
    compute_global_limits,
)
from parallel.shm_allreduce import ShmAllReduce


def check_global(config: CapacityConfig | None) -> None:
    """A dispatcher enforces only the "global" scope (the MoE layer enforces "local")."""
    if config is not None and config.enabled and config.scope != "global":
        raise ValueError(f"a dispatcher enforces capacity_scope 'global', got {config.scope!r}")


def gather_slot_counts(slot_ids: torch.Tensor, num_slots: int, group: dist.ProcessGroup,
                       shm: ShmAllReduce | None = None) -> torch.Tensor:
    """Collective over ``group`` (through ``shm``, its shared memory, where given and the counts fit).
    slot_ids: [T, K]. Returns [R, P + 1] int64: row r = rank r's assignments per slot, then its token
    count."""
    valid = slot_ids[slot_ids >= 0]
    mine = torch.zeros(num_slots + 1, dtype=torch.int64, device=slot_ids.device)
    mine[:num_slots] = torch.bincount(valid, minlength=num_slots)
    mine[num_slots] = slot_ids.shape[0]
    if shm is not None and shm.fits(mine):  # the same size on every rank: every rank takes this branch
        return shm.all_gather(mine)
    out = torch.empty(dist.get_world_size(group) * (num_slots + 1), dtype=torch.int64, device=slot_ids.device)
    dist.all_gather_single(out, mine, group=group)
    return out.view(-1, num_slots + 1).cpu()


def apply_global_capacity(
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    counts: torch.Tensor,
    rank: int,
    top_k: int,
    config: CapacityConfig,
) -> tuple[torch.Tensor, torch.Tensor, CapacityStats]:
    """slot_ids / weights: [T, K] this rank's assignments; counts: [R, P + 1] from
    ``gather_slot_counts``; rank: this rank's index in it.

    Returns this rank's slot ids [T, K] (-1 where dropped) and weights [T, K] float32 (0 where
    dropped, renormalised if the config asks), and its ``CapacityStats``: assignments / dropped
    are this source rank's (summing them over the EP group gives the group's totals);
    max_slot_load and capacity are group-wide (the same on every rank)."""
    num_slots = counts.shape[1] - 1
    per_slot = counts[:, :num_slots]
    capacity = compute_capacity(int(counts[:, num_slots].sum()), num_slots, top_k,
                                config.capacity_factor, config.min_capacity)
    if capacity is None:
        raise ValueError("apply_global_capacity called with a dropless (capacity_factor <= 0) config")
    limits = compute_global_limits(per_slot, capacity)  # [R, P]
    if not config.renormalize and kernels.cpu_kernel_applies(slot_ids, weights):
        ids, kept_weights, _ = kernels.capacity_drop(slot_ids, weights, num_slots, capacity, limits[rank].contiguous())
    else:
        result = apply_slot_limits(slot_ids, weights, limits[rank].to(slot_ids.device),
                                   renormalize=config.renormalize, capacity=capacity)
        ids, kept_weights = result.topk_ids, result.topk_weights
    accepted = limits.sum(0)
    mine = int(per_slot[rank].sum())
    stats = CapacityStats(
        assignments=mine,
        dropped=mine - int(limits[rank].sum()),
        rerouted=0,
        max_slot_load=int(accepted.max()) if accepted.numel() else 0,
        capacity=capacity,
    )
    return ids, kept_weights, stats


class EPDispatcherState:
    """What every EP dispatcher holds: the EP group and its shared memory (``shm``: ranks on one host;
    None where the group has none), this rank's EP coordinates, an optional global capacity (None
    when disabled) and the last step's ``capacity_stats[layer_id]``."""

    def __init__(
        self, group: dist.ProcessGroup, rank: int, num_ranks: int, *, global_capacity: CapacityConfig | None = None,
        shm: ShmAllReduce | None = None,
    ) -> None:
        if not 0 <= rank < num_ranks:
            raise ValueError(f"EP rank {rank} outside EP size {num_ranks}")
        check_global(global_capacity)
        self.group = group
        self.shm = shm  # a decode step's small exchanges go through it; larger ones through gloo
        self.rank = rank
        self.num_ranks = num_ranks
        self.global_capacity = global_capacity if global_capacity is not None and global_capacity.enabled else None
        self.capacity_stats: dict[int, CapacityStats] = {}
