"""Dropless, deduplicated AllToAll-v expert dispatch over the EP group.

Shape legend: T tokens on this rank, D hidden, K top-k, R EP ranks, N rows sent
(unique (token, destination rank) pairs), M rows received, P_local slots per rank.

One ``dispatch_combine`` = up to four collectives, entered by every EP rank in the same
order whatever its T (a rank that skipped one would hang the group):

1. (global capacity only) all-gather per-slot assignment counts;
2. all-to-all of the per-rank row counts;
3. all-to-all-v of the packed rows (hidden + the token's (physical slot, weight) list), once per
   (token, destination rank);
4. after the grouped expert GEMMs and the per-row weighted sum on the destination
   (fp32 accumulation, one rounding to the activation dtype), all-to-all-v of one partial
   row back per (token, destination rank); the source sums each token's rows (at most
   min(K, R)) with one gather + sum in fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe import kernels
from moe.capacity import CapacityConfig
from moe.experts import Experts
from parallel.dispatch.global_capacity import (
    EPDispatcherState,
    apply_global_capacity,
    gather_slot_counts,
)
from parallel.dispatch.plan import (
    DispatchPlan,
    check_dispatch_args,
    combine_rows,
    destination_mask,
    localize_slots,
    pack_rows,
    plan_from_mask,
    row_layout,
    unpack_rows,
)
from parallel.dispatch.workspace import Workspace
from parallel.shm_allreduce import ShmAllReduce


class AllToAllDispatcher(EPDispatcherState):
    """ExpertDispatcher over ``group`` (the EP group); ``rank``/``num_ranks`` are EP coordinates.

    ``capacity_stats[layer_id]`` holds the last step's ``CapacityStats`` when a global
    capacity is configured: this rank's assignments / dropped (sum over EP ranks for the
    group), group-wide max_slot_load and capacity.
    """

    def __init__(
        self, group: dist.ProcessGroup, rank: int, num_ranks: int, *, global_capacity: CapacityConfig | None = None,
        shm: ShmAllReduce | None = None,
    ) -> None:
        super().__init__(group, rank, num_ranks, global_capacity=global_capacity, shm=shm)
        self.workspace = Workspace()

    def dispatch_combine(
        self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, experts: Experts, layer_id: int
    ) -> torch.Tensor:
        """x: [T, D]; slot_ids: [T, K] int64 physical slots (-1 dropped); weights: [T, K] float32.
        Returns: [T, D] float32. Collective: every EP rank calls it, T = 0 included."""
        check_dispatch_args(x, slot_ids, weights, experts.hidden_size)
        num_local = experts.num_local_slots
        slot_ids, weights = self._apply_capacity(slot_ids, weights, num_local, layer_id)
        plan, recv, recv_counts = self.dispatch(x, slot_ids, weights, num_local)
        rx, rslots, rweights = unpack_rows(recv, x.shape[1], slot_ids.shape[1], x.dtype)
        # [M, D]: on CPU one op over the receive buffer's rows (the wire's physical slots localized in it)
        partial = experts.forward_rows_fused(rx, rslots, rweights, self.rank * num_local)
        if partial is None:
            partial = experts.forward_rows(rx, localize_slots(rslots, self.rank, num_local), rweights)
        return self.combine(partial, plan, recv_counts)

    def dispatch(
        self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, num_local_slots: int
    ) -> tuple[DispatchPlan, torch.Tensor, list[int]]:
        """Plan and send each (token, destination rank) row: x [T, D] with its [T, K] slots and
        weights. Returns (plan; received rows [M, row_bytes] uint8, valid until the next
        call; rows received from each rank: R ints). On CPU the plan and the packed rows come
        from one C++ op (``kernels.dispatch_plan``); else the count exchange runs while the
        rest of the plan is computed and the rows are packed. Both send from the reused
        ``send`` buffer."""
        _, row_bytes = row_layout(x.shape[1], slot_ids.shape[1], x.dtype)
        # with shared memory the counts ride with the rows; rows past its capacity go through gloo
        plan, send, counts = self._plan_and_pack(x, slot_ids, weights, num_local_slots, row_bytes,
                                                 exchange_counts=self.shm is None)
        if counts is None:
            assert self.shm is not None
            recv, recv_counts = self.shm.all_to_all_v(send, plan.send_counts)
            if recv is not None:
                return plan, recv, recv_counts
        else:
            recv_counts_t, work = counts
            work.wait()
            recv_counts = recv_counts_t.tolist()
        recv = self.workspace.get("recv", (sum(recv_counts), row_bytes), torch.uint8, x.device)
        dist.all_to_all_single(recv, send, recv_counts, plan.send_counts, group=self.group)
        return plan, recv, recv_counts

    def _plan_and_pack(self, x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, num_local_slots: int,
                       row_bytes: int, *, exchange_counts: bool
                       ) -> tuple[DispatchPlan, torch.Tensor, tuple[torch.Tensor, dist.Work] | None]:
        """The plan and the packed rows [N, row_bytes] uint8 in the reused send buffer (one C++ op on
        CPU), and with ``exchange_counts`` the started count exchange (``_exchange_counts``: with the
        tensor ops it runs while the rest of the plan is computed and the rows are packed), else None."""
        if kernels.cpu_kernel_applies(x, slot_ids, weights):
            bound = x.shape[0] * min(slot_ids.shape[1], self.num_ranks)  # rows a token can need
            space = self.workspace.get("send", (bound, row_bytes), torch.uint8, x.device)
            send, pair_token, send_counts, combine_index, combine_offsets = kernels.dispatch_plan(
                x, slot_ids, weights, num_local_slots, self.num_ranks, space)
            plan = DispatchPlan(pair_token, send_counts.tolist(), combine_index, combine_offsets)
            return plan, send, self._exchange_counts(send_counts) if exchange_counts else None
        mask = destination_mask(slot_ids, num_local_slots, self.num_ranks)  # [R, T]
        counts = self._exchange_counts(mask.sum(1)) if exchange_counts else None
        plan = plan_from_mask(mask)
        send = self.workspace.get("send", (plan.num_rows, row_bytes), torch.uint8, x.device)
        pack_rows(x, slot_ids, weights, plan, send)
        return plan, send, counts

    def _exchange_counts(self, send_counts: torch.Tensor) -> tuple[torch.Tensor, dist.Work]:
        """Start the all-to-all of the per-rank row counts [R]: (the counts each rank sends here,
        filled once the returned work is waited on; the work)."""
        recv_counts = torch.empty_like(send_counts)
        return recv_counts, dist.all_to_all_single(recv_counts, send_counts, group=self.group, async_op=True)

    def combine(self, partial: torch.Tensor, plan: DispatchPlan, recv_counts: list[int]) -> torch.Tensor:
        """partial: [M, D] one weighted row per received row, in the activation dtype.
        Returns [T, D] float32: the fp32 sum of the partial rows sent back for each token."""
        if self.shm is not None:
            back, _ = self.shm.all_to_all_v(partial.contiguous(), recv_counts)
            if back is not None:
                return combine_rows(back, plan)
        back = self.workspace.get("back", (plan.num_rows, partial.shape[1]), partial.dtype, partial.device)
        dist.all_to_all_single(back, partial.contiguous(), plan.send_counts, recv_counts, group=self.group)
        return combine_rows(back, plan)

    def _apply_capacity(
        self, slot_ids: torch.Tensor, weights: torch.Tensor, num_local_slots: int, layer_id: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.global_capacity is None:
            return slot_ids, weights
        num_slots = num_local_slots * self.num_ranks
        counts = gather_slot_counts(slot_ids, num_slots, self.group, self.shm)  # collective: every rank, every step
        ids, kept_weights, stats = apply_global_capacity(
            slot_ids, weights, counts, self.rank, slot_ids.shape[1], self.global_capacity
        )
        self.capacity_stats[layer_id] = stats
        return ids, kept_weights
