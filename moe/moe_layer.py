"""The MoE feed-forward: router -> replica choice -> (capacity) -> dispatch -> + shared experts.

Shape legend: T tokens, D hidden, K top-k, E logical experts, P physical slots,
R max replicas of one expert.

Logical expert e has ``logcnt[e]`` physical copies ``log2phy[e, :logcnt[e]]``. The
assignments of one expert in a step are spread over its copies round-robin by their
occurrence index in the batch, offset by this rank (deterministic, even: replica counts
differ by at most one); the copies are ordered so that a rank's first assignment goes to a copy on
that rank where it holds one (``compute_placement_tables``). ``slot_load [P]`` accumulates
assignments per slot (before any capacity drop: it measures demand); the worker reads and resets it.

On CPU, a rank that hosts every slot with no capacity enforcement runs the whole
feed-forward (router, replica choice, slot load, routed and shared experts) as one op,
``kernels.moe_ffn``, bit-equal to the op-by-op path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moe import kernels
from moe.capacity import CapacityConfig, apply_capacity
from moe.config import ModelConfig
from moe.dispatch import ExpertDispatcher, LocalDispatcher
from moe.experts import Experts, count_ids
from moe.layers.mlp import DenseMLP
from moe.plan_watch import WatchedModule
from moe.router import Router


def compute_placement_tables(phy2log_row: torch.Tensor, num_experts: int,
                             num_ranks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """phy2log_row: [P] logical expert of each slot (slot p on EP rank p // (P / num_ranks)). Returns
    log2phy [E, R] int64 (-1 padded) and logcnt [E] int64. Every expert needs at least one slot.

    An expert's copies are ordered for ``choose_replicas``, which sends a rank's first assignment of
    expert e to copy ``rank % logcnt[e]``: copy i is, where one exists, on a rank r with r % logcnt[e] == i
    (the lowest such rank), so a rank holding a copy uses its own (a decode step seldom routes an expert
    twice from one rank), and copies on one rank do not take the traffic of every rank; the copies left
    fill the other places in slot order. With one rank: slots in increasing order."""
    phy2log_row = torch.as_tensor(phy2log_row, dtype=torch.int64).reshape(-1).cpu()
    if phy2log_row.numel() and (phy2log_row.min() < 0 or phy2log_row.max() >= num_experts):
        raise ValueError(f"phy2log entries must be in [0, {num_experts}), got {phy2log_row.tolist()}")
    logcnt = torch.bincount(phy2log_row, minlength=num_experts)
    if (logcnt == 0).any():
        missing = torch.nonzero(logcnt == 0).flatten().tolist()
        raise ValueError(f"experts {missing} have no physical slot in phy2log")
    order = torch.argsort(phy2log_row, stable=True)  # slots grouped by expert, ascending
    starts = torch.cumsum(logcnt, 0) - logcnt
    rank_in_expert = torch.arange(order.numel()) - starts[phy2log_row[order]]
    log2phy = torch.full((num_experts, int(logcnt.max())), -1, dtype=torch.int64)
    log2phy[phy2log_row[order], rank_in_expert] = order
    if num_ranks > 1 and int(logcnt.max()) > 1:
        per_rank = phy2log_row.numel() // num_ranks
        for e in torch.nonzero(logcnt > 1).flatten().tolist():
            log2phy[e, : logcnt[e]] = torch.tensor(_copies_by_rank(log2phy[e, : logcnt[e]].tolist(), per_rank,
                                                                    num_ranks))
    return log2phy, logcnt


def _copies_by_rank(slots: list[int], per_rank: int, num_ranks: int) -> list[int]:
    """``slots`` (one expert's copies, ascending) in ``compute_placement_tables``' order."""
    count = len(slots)
    by_rank: dict[int, list[int]] = {}
    for slot in slots:
        by_rank.setdefault(slot // per_rank, []).append(slot)
    placed: list[int | None] = [None] * count
    for i in range(count):
        for rank in range(i, num_ranks, count):  # the ranks whose first assignment goes to copy i
            if by_rank.get(rank):
                placed[i] = by_rank[rank].pop(0)
                break
    rest = iter(sorted(s for left in by_rank.values() for s in left))
    return [slot if slot is not None else next(rest) for slot in placed]


def choose_replicas(topk_ids: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, rank: int) -> torch.Tensor:
    """topk_ids: [T, K] logical. Returns slot_ids [T, K] int64: the n-th assignment of expert e
    in the batch (row-major) goes to replica (n + rank) % logcnt[e]."""
    flat = topk_ids.reshape(-1)
    if log2phy.shape[1] == 1:
        return log2phy[flat, 0].view_as(topk_ids)
    counts = count_ids(flat, logcnt.shape[0])
    order = torch.argsort(flat, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    occurrence = torch.empty_like(flat)
    occurrence[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    replica = (occurrence + rank) % logcnt[flat]
    return log2phy[flat, replica].view_as(topk_ids)


def compute_slot_scores(scores: torch.Tensor, topk_ids: torch.Tensor, phy2log: torch.Tensor) -> torch.Tensor:
    """Router selection scores seen per physical slot, for rerouting an over-full slot's tokens.

    scores: [T, E] float32 (-inf where the router may not pick an expert, e.g. outside the
    token's top groups); topk_ids: [T, K] logical experts the token already uses; phy2log: [P].
    Returns [T, P]: a slot scores as its logical expert; every copy of an expert the token
    already uses is -inf, so a reroute never sends a token to the same expert twice."""
    used = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, topk_ids, True)  # [T, E]
    slot = scores[:, phy2log]
    return slot.masked_fill(used[:, phy2log], float("-inf"))


class MoELayer(WatchedModule):
    """Routed experts (hosted slots only) plus shared experts. x: [T, D] -> [T, D] in x's dtype."""

    DECISION_ATTRS = ("use_fused_ffn", "capacity", "dispatcher", "top_k")  # fused_ffn_op's switches

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        *,
        dtype: torch.dtype = torch.float32,
        local_slots: Sequence[int] | None = None,
        dispatcher: ExpertDispatcher | None = None,
        capacity: CapacityConfig | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.gate = Router(config)
        slots = list(range(config.num_experts)) if local_slots is None else [int(s) for s in local_slots]
        self.experts = Experts(len(slots), config.hidden_size, config.moe_intermediate_size,
                               torch.tensor(slots, dtype=torch.int64), dtype=dtype)
        shared = config.moe_intermediate_size * config.num_shared_experts
        self.shared_experts = DenseMLP(config.hidden_size, shared, dtype) if shared else None
        self.dispatcher: ExpertDispatcher = dispatcher if dispatcher is not None else LocalDispatcher()
        # the layer enforces the "local" scope; the dispatcher enforces "global" (None here)
        self.capacity = capacity if capacity is not None and capacity.is_local else None
        self.counters = {"dropped": 0, "rerouted": 0}
        self.rank = int(getattr(self.dispatcher, "rank", 0))
        self.num_ranks = int(getattr(self.dispatcher, "num_ranks", 1))
        log2phy, logcnt = compute_placement_tables(torch.arange(config.num_experts), config.num_experts)
        self.register_buffer("phy2log", torch.arange(config.num_experts), persistent=False)
        self.register_buffer("log2phy", log2phy, persistent=False)
        self.register_buffer("logcnt", logcnt, persistent=False)
        self.register_buffer("slot_load", torch.zeros(config.num_experts, dtype=torch.int64), persistent=False)
        # the whole feed-forward as one CPU op where it applies (False: op by op, the reference)
        self.use_fused_ffn = True

    # [T] int64 weight of each row in the slot-load count (1 a real row, 0 padding), set around a
    # padded forward (moe.cuda_graphs); None: every row counts. The op-by-op path reads it.
    count_rows: torch.Tensor | None = None

    def set_count_rows(self, rows: torch.Tensor | None) -> None:
        """Set ``count_rows`` without announcing a change (``moe.plan_watch``): it is neither a weight
        nor a switch a decode plan resolves."""
        self.__dict__["count_rows"] = rows

    @property
    def num_physical_slots(self) -> int:
        return int(self.slot_load.shape[0])

    def set_placement(self, phy2log_row: torch.Tensor | Sequence[int], num_ranks: int, rank: int) -> None:
        """Install a placement: phy2log_row [P] (logical expert per physical slot). Resets slot_load.
        The hosted expert weights are moved separately (the migration owns Experts)."""
        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank {rank} out of range for num_ranks {num_ranks}")
        row = torch.as_tensor(phy2log_row, dtype=torch.int64).reshape(-1)
        if row.numel() % num_ranks:
            raise ValueError(f"{row.numel()} physical slots do not split over {num_ranks} ranks")
        log2phy, logcnt = compute_placement_tables(row, self.num_experts, num_ranks)
        device = self.slot_load.device
        self.log2phy, self.logcnt = log2phy.to(device), logcnt.to(device)
        self.phy2log = row.to(device)
        self.slot_load = torch.zeros(row.numel(), dtype=torch.int64, device=device)
        self.num_ranks, self.rank = num_ranks, rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, D]. Every EP rank must call this for every layer of every step, even with T = 0:
        ``dispatch_combine`` is a collective."""
        fused = self.fused_ffn_op(x)
        if fused is not None:  # router, replicas, slot load, routed and shared experts in one CPU op
            return fused(x)
        reroute = self.capacity is not None and self.capacity.overflow == "reroute"
        topk_ids, weights, scores = self.gate.route(x, with_scores=reroute)  # [T, K], [T, K], [T, E] | None
        buffers = self._buffers
        load, rows = buffers["slot_load"], self.count_rows
        if rows is None and topk_ids.dtype == torch.int64 and kernels.cpu_kernel_applies(topk_ids, load):
            # the replicas and the slot load in one pass: ~70 us a layer less than the tensor ops
            slot_ids = kernels.choose_slots(topk_ids, buffers["log2phy"], buffers["logcnt"], self.rank, load)
        else:
            slot_ids = choose_replicas(topk_ids, buffers["log2phy"], buffers["logcnt"], self.rank)
            if slot_ids.numel():  # in place, not `self.slot_load += ...`: that re-assigns the buffer through
                # nn.Module.__setattr__ (15 us of CPU per call measured) and announces a placement change
                counted = None if rows is None else rows[:, None].expand(slot_ids.shape).reshape(-1)  # padding: 0
                load.add_(count_ids(slot_ids.reshape(-1), load.shape[0], weights=counted))  # no host read on CUDA
        if self.capacity is not None:
            slot_ids, weights = self._apply_capacity(slot_ids, weights, topk_ids, scores)
        out = self.dispatcher.dispatch_combine(x, slot_ids, weights, self.experts, self.layer_id)  # [T, D] f32
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).float()
        return out.to(x.dtype)

    def fused_ffn_op(self, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """``kernels.moe_ffn`` with this layer's router and expert weights bound, when it can stand in
        for this forward on x [T, D] (``_fused_ffn_weights``), else None. The op maps x [T, D] ->
        [T, D] and reads the placement (log2phy, logcnt, rank, slot_load) at each call; its weights
        hold until one of them or a switch changes. With a local capacity it drops over-capacity
        assignments in token order as ``_apply_capacity`` does, counting them in ``counters``."""
        fused = self._fused_ffn_weights(x) if self.use_fused_ffn else None
        if fused is None:
            return None
        gate = self._modules["gate"]
        run = kernels.moe_ffn_op(gate._parameters["weight"], **gate.selection_args(), packed=fused[0],
                                 shared=fused[1], gate_parts=gate.logits_parts(x))
        buffers = self._buffers
        cap = self.capacity
        if cap is None:
            def ffn(x: torch.Tensor) -> torch.Tensor:
                return run(x, buffers["log2phy"], buffers["logcnt"], self.rank, buffers["slot_load"])

            return ffn
        dropped = torch.zeros(1, dtype=torch.int64)
        counters, top_k = self.counters, self.top_k

        def ffn_capped(x: torch.Tensor) -> torch.Tensor:
            load = buffers["slot_load"]
            limit = cap.capacity_for(x.shape[0], load.shape[0], top_k)
            out = run(x, buffers["log2phy"], buffers["logcnt"], self.rank, load, limit, dropped)
            counters["dropped"] += int(dropped[0])
            return out

        return ffn_capped

    def _fused_ffn_weights(self, x: torch.Tensor
                           ) -> tuple[kernels.PackedExperts, kernels.PackedExperts | None] | None:
        """(routed, shared or None) packed weights when ``kernels.moe_ffn`` can stand in for this
        forward on x [T, D], else None: one rank hosts every slot (no dispatcher), any local capacity
        drops in token order (``CapacityConfig.drops_in_token_order``), and every op of the op-by-op
        path would take its CPU kernel (router selection, the routed experts from the router's
        output, the shared experts)."""
        if self.capacity is not None and not self.capacity.drops_in_token_order:
            return None
        if type(self.dispatcher) is not LocalDispatcher:
            return None
        if self.count_rows is not None:  # padded rows must count nothing in slot_load: the op counts every row
            return None
        mods = self._modules  # submodules and parameters without nn.Module.__getattr__ (every layer, every step)
        gate = mods["gate"]
        weight = gate._parameters["weight"]
        if not gate.use_kernel or weight.dtype != torch.float32 or not weight.is_cpu or not kernels.cpu_op_applies(x):
            return None
        if kernels.needs_autograd(x, weight, gate._parameters.get("e_score_correction_bias")):
            return None
        if not self._buffers["slot_load"].is_cpu:
            return None
        routed = mods["experts"].fused_packed_for(x, x.shape[0] * self.top_k)
        if routed is None:
            return None
        shared_mlp = mods.get("shared_experts")  # None: not a registered module
        shared = None
        if shared_mlp is not None:
            shared = shared_mlp._packed_weights(x)
            if shared is None:
                return None
        return routed, shared

    def _apply_capacity(self, slot_ids: torch.Tensor, weights: torch.Tensor, topk_ids: torch.Tensor,
                        scores: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Local-scope capacity (before dispatch): dropped assignments get slot -1, weight 0.
        slot_ids / weights / topk_ids: [T, K]; scores: [T, E] router selection scores (reroute only)."""
        cap = self.capacity
        assert cap is not None
        if cap.drops_in_token_order and kernels.cpu_kernel_applies(slot_ids, weights):
            # one pass in C++: the values apply_capacity gives below, without its ~20 tensor ops
            limit = cap.capacity_for(slot_ids.shape[0], self.num_physical_slots, max(slot_ids.shape[1], 1))
            if limit is not None:
                ids, kept_weights, dropped = kernels.capacity_drop(slot_ids, weights, self.num_physical_slots, limit)
                self.counters["dropped"] += dropped
                return ids, kept_weights
        slot_scores = None if scores is None else compute_slot_scores(scores, topk_ids, self.phy2log)
        result = apply_capacity(slot_ids, weights, self.num_physical_slots, cap.capacity_factor,
                                min_capacity=cap.min_capacity, policy=cap.policy, overflow=cap.overflow,
                                renormalize=cap.renormalize, router_scores=slot_scores)
        stats = result.stats
        self.counters["dropped"] += stats.dropped
        self.counters["rerouted"] += stats.rerouted
        return result.topk_ids, result.topk_weights.float()
