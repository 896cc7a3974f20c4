"""All-gather / reduce-scatter expert dispatch (vLLM's default on CPU and small EP groups).

Shape legend: T tokens on this rank, T_max the largest T in the EP group, D hidden,
K top-k, R EP ranks.

Every rank gathers every rank's tokens (padded to T_max, since the collectives need
equal sizes), runs its own slots over all of them, and reduce-scatters the fp32
partial sums so each rank gets its own T rows back. Simple and dedup-free; it moves
R x the tokens, so the AllToAll dispatcher wins once R grows. On one host a decode step's
gathers and reduce-scatter go through the EP group's shared memory (``parallel.shm_allreduce``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe.capacity import CapacityStats, apply_slot_limits, compute_capacity
from moe.experts import Experts
from parallel.dispatch.global_capacity import EPDispatcherState
from parallel.dispatch.plan import check_dispatch_args, pack_token_rows, unpack_rows


class AllGatherDispatcher(EPDispatcherState):
    """ExpertDispatcher over ``group`` (the EP group); ``rank``/``num_ranks`` are EP coordinates.

    With a global capacity, C is applied to the gathered batch in EP-rank then token order,
    the same decisions as the AllToAll dispatcher; ``capacity_stats[layer_id]`` records them.

    With ``shm`` (the EP group's shared memory, ranks on one host) a step's rows go in one
    all-gather of each rank's packed rows (``pack_token_rows``: hidden, slots and weights, no
    padding to T_max) and the partial sums come back in one shared-memory reduce-scatter, in
    place of gloo's four all-gathers and its reduce-scatter. Where any rank's rows or the
    partial sums exceed its capacity (prefill), every rank sees that alike and uses gloo.
    """

    def dispatch_combine(
        self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, experts: Experts, layer_id: int
    ) -> torch.Tensor:
        """x: [T, D]; slot_ids: [T, K] int64 physical slots (-1 dropped); weights: [T, K] float32.
        Returns: [T, D] float32. Collective: every EP rank calls it, T = 0 included."""
        check_dispatch_args(x, slot_ids, weights, experts.hidden_size)
        num_tokens, top_k = slot_ids.shape
        gathered, sizes = None, None
        if self.shm is not None:
            packed, sizes = self.shm.all_gather_v(pack_token_rows(x, slot_ids, weights))
            if packed is not None:
                rx, rslots, rweights = unpack_rows(packed, x.shape[1], top_k, x.dtype)
                gathered = rx.contiguous(), rslots.to(torch.int64), rweights.contiguous()
        if sizes is None:
            sizes = self._gather_sizes(num_tokens, x.device)
        t_max = max(sizes)
        if t_max == 0:  # every rank sees the same sizes, so every rank returns here together
            if self.global_capacity is not None:
                cap = compute_capacity(0, experts.num_local_slots * self.num_ranks, max(top_k, 1),
                                       self.global_capacity.capacity_factor, self.global_capacity.min_capacity)
                self.capacity_stats[layer_id] = CapacityStats(0, 0, 0, 0, cap)
            return torch.zeros((0, x.shape[1]), dtype=torch.float32, device=x.device)
        if gathered is not None:  # [N, D], [N, K], [N, K]: every rank's rows back to back
            x_all, ids_all, w_all = gathered
            first = sum(sizes[: self.rank])
        else:  # [R * T_max, ...]: each rank's rows padded to T_max
            x_all = self._gather_padded(x, t_max)
            ids_all = self._gather_padded(slot_ids.to(torch.int64), t_max, fill=-1)
            w_all = self._gather_padded(weights.float(), t_max)
            first = self.rank * t_max
        if self.global_capacity is not None:
            ids_all, w_all = self._apply_capacity(ids_all, w_all, sizes, first, experts, layer_id)
        lo = self.rank * experts.num_local_slots
        mine = (ids_all >= lo) & (ids_all < lo + experts.num_local_slots)
        local_ids = torch.where(mine, ids_all - lo, torch.full_like(ids_all, -1))
        partial = experts(x_all, local_ids, w_all)  # [N or R * T_max, D] float32
        if gathered is not None and self.shm is not None and self.shm.applies(partial):
            return self.shm.reduce_scatter(partial, first, first + num_tokens)
        if gathered is not None:  # the sums past the segment: gloo's reduce-scatter wants T_max blocks
            partial = self._pad_blocks(partial, sizes, t_max)
        out = torch.empty((t_max, x.shape[1]), dtype=torch.float32, device=x.device)
        dist.reduce_scatter_single(out, partial, group=self.group)
        return out[:num_tokens]

    def _pad_blocks(self, rows: torch.Tensor, sizes: list[int], t_max: int) -> torch.Tensor:
        """rows [sum(sizes), D], each rank's back to back -> [R * T_max, D], each rank's block padded
        with zeros to T_max."""
        out = torch.zeros((self.num_ranks * t_max, rows.shape[1]), dtype=rows.dtype, device=rows.device)
        at = 0
        for r, n in enumerate(sizes):
            out[r * t_max : r * t_max + n] = rows[at : at + n]
            at += n
        return out

    def _gather_sizes(self, num_tokens: int, device: torch.device) -> list[int]:
        mine = torch.tensor([num_tokens], dtype=torch.int64, device=device)
        out = torch.empty(self.num_ranks, dtype=torch.int64, device=device)
        dist.all_gather_single(out, mine, group=self.group)
        return out.tolist()

    def _gather_padded(self, t: torch.Tensor, t_max: int, fill: float = 0) -> torch.Tensor:
        padded = torch.full((t_max, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
        padded[: t.shape[0]] = t
        out = torch.empty((self.num_ranks * t_max, *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_gather_single(out, padded, group=self.group)
        return out

    def _apply_capacity(
        self, ids_all: torch.Tensor, w_all: torch.Tensor, sizes: list[int], first: int, experts: Experts,
        layer_id: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Capacity over the gathered batch (EP-rank order, pads are -1 and ignored; this rank's
        rows start at row ``first``). Stats: this rank's assignments / dropped, group-wide
        max_slot_load and capacity."""
        cfg = self.global_capacity
        assert cfg is not None
        num_slots = experts.num_local_slots * self.num_ranks
        capacity = compute_capacity(sum(sizes), num_slots, ids_all.shape[1], cfg.capacity_factor, cfg.min_capacity)
        limits = torch.full((num_slots,), capacity, dtype=torch.int64, device=ids_all.device)
        result = apply_slot_limits(ids_all, w_all, limits, renormalize=cfg.renormalize, capacity=capacity)
        valid = ids_all[first : first + sizes[self.rank]] >= 0
        kept = result.kept[first : first + sizes[self.rank]]
        group = result.stats
        self.capacity_stats[layer_id] = CapacityStats(
            int(valid.sum()), int((valid & ~kept).sum()), 0, group.max_slot_load, capacity)
        return result.topk_ids, result.topk_weights
