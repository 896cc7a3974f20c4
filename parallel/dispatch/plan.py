"""Pure planning for the deduplicated AllToAll-v: which rows go where, and their wire format.

Shape legend: T tokens on this rank, D hidden, K top-k, R EP ranks, N (token,
destination rank) pairs sent, M pairs received.

A token is sent once per destination rank, however many of its top-k slots live there
(DeepEP-style dedup). Each sent row carries the token's hidden vector plus a K-wide
list of (local slot, weight) for the assignments it has on that rank (-1 / 0 padded;
column k is the token's k-th assignment, so no compaction is needed). The destination
sums the expert outputs of those assignments, weighted, before sending one row back.

Wire format of one dispatched row (one uint8 buffer, one collective):
``[hidden: D * itemsize bytes, padded to 8 | local slots: K int32 | weights: K float32]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DispatchPlan:
    """Rows to send, grouped by destination EP rank (ascending), tokens ascending inside.

    pair_token: [N] int64 source token of each row; send_counts: R ints (rows per rank);
    local_slots: [N, K] int32 slot on the destination, -1 where token t's k-th assignment
    is not for that rank; weights: [N, K] float32, 0 where local_slots is -1.
    """

    pair_token: torch.Tensor
    send_counts: list[int]
    local_slots: torch.Tensor
    weights: torch.Tensor


def compute_dispatch_plan(
    slot_ids: torch.Tensor, weights: torch.Tensor, num_local_slots: int, num_ranks: int
) -> DispatchPlan:
    """slot_ids: [T, K] int64 physical slots (-1 dropped), slot p on rank p // num_local_slots;
    weights: [T, K] float. Returns the deduplicated ``DispatchPlan``."""
    slot_ids = slot_ids.to(torch.int64)
    num_tokens, top_k = slot_ids.shape
    num_slots = num_local_slots * num_ranks
    if slot_ids.numel() and int(slot_ids.max()) >= num_slots:
        raise ValueError(
            f"slot id {int(slot_ids.max())} out of range: {num_ranks} ranks x {num_local_slots} local slots"
        )
    t_idx, k_idx = torch.nonzero(slot_ids >= 0, as_tuple=True)
    slots = slot_ids[t_idx, k_idx]
    dest = torch.div(slots, num_local_slots, rounding_mode="floor")
    # dense [R, T] "token t goes to rank r": O(R*T) with no sort; R is small
    has = torch.zeros(num_ranks * num_tokens, dtype=torch.bool, device=slot_ids.device)
    key = dest * num_tokens + t_idx  # rank-major, then token
    has[key] = True
    row_id = torch.cumsum(has, 0) - 1
    pair_token = torch.nonzero(has, as_tuple=False).squeeze(1) % max(num_tokens, 1)
    send_counts = has.view(num_ranks, num_tokens).sum(1)
    row_of = row_id[key]
    n = pair_token.numel()
    local_slots = torch.full((n, top_k), -1, dtype=torch.int32, device=slot_ids.device)
    local_slots[row_of, k_idx] = (slots - dest * num_local_slots).to(torch.int32)
    w = torch.zeros((n, top_k), dtype=torch.float32, device=slot_ids.device)
    w[row_of, k_idx] = weights[t_idx, k_idx].float()
    return DispatchPlan(pair_token, send_counts.tolist(), local_slots, w)


def row_layout(hidden_size: int, top_k: int, dtype: torch.dtype) -> tuple[int, int]:
    """(hidden bytes padded to 8, total row bytes) of the dispatch wire format."""
    hidden_bytes = hidden_size * torch.empty((), dtype=dtype).element_size()
    hidden_bytes = (hidden_bytes + 7) // 8 * 8
    return hidden_bytes, hidden_bytes + 8 * top_k


def pack_rows(x: torch.Tensor, plan: DispatchPlan, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, D]. Returns the send buffer [N, row_bytes] uint8 (one gather of x, no other copy),
    written into ``out`` when given (a reused buffer of that shape)."""
    hidden_size, top_k = x.shape[1], plan.local_slots.shape[1]
    hidden_bytes, row_bytes = row_layout(hidden_size, top_k, x.dtype)
    shape = (plan.pair_token.numel(), row_bytes)
    if out is not None and (tuple(out.shape) != shape or out.dtype != torch.uint8):
        raise ValueError(f"pack_rows out must be {shape} uint8, got {tuple(out.shape)} {out.dtype}")
    buf = torch.empty(shape, dtype=torch.uint8, device=x.device) if out is None else out
    nbytes = hidden_size * x.element_size()
    torch.index_select(x, 0, plan.pair_token, out=buf[:, :nbytes].view(x.dtype))
    buf[:, hidden_bytes : hidden_bytes + 4 * top_k].view(torch.int32).copy_(plan.local_slots)
    buf[:, hidden_bytes + 4 * top_k :].view(torch.float32).copy_(plan.weights)
    return buf


def unpack_rows(
    buf: torch.Tensor, hidden_size: int, top_k: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """buf: [M, row_bytes] uint8. Returns views (x [M, D] dtype, local_slots [M, K] int32,
    weights [M, K] float32) into ``buf``."""
    hidden_bytes, row_bytes = row_layout(hidden_size, top_k, dtype)
    if buf.dim() != 2 or buf.shape[1] != row_bytes:
        raise ValueError(f"dispatch buffer must be [M, {row_bytes}] uint8, got {tuple(buf.shape)}")
    nbytes = hidden_size * torch.empty((), dtype=dtype).element_size()
    x = buf[:, :nbytes].view(dtype)
    slots = buf[:, hidden_bytes : hidden_bytes + 4 * top_k].view(torch.int32)
    weights = buf[:, hidden_bytes + 4 * top_k :].view(torch.float32)
    return x, slots, weights


def split_sizes(total: int, parts: int) -> list[int]:
    """torch.tensor_split sizes: ``parts`` ints summing to ``total``, the first ``total % parts`` one larger."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def check_dispatch_args(x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, hidden_size: int) -> None:
    """Raise ValueError naming the problem unless x [T, D], slot_ids [T, K] int, weights [T, K]."""
    if x.dim() != 2 or x.shape[1] != hidden_size:
        raise ValueError(f"x must be [T, {hidden_size}], got {tuple(x.shape)}")
    if slot_ids.dim() != 2 or slot_ids.shape[0] != x.shape[0]:
        raise ValueError(f"slot_ids must be [T={x.shape[0]}, K], got {tuple(slot_ids.shape)}")
    if slot_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_ids must be int64, got {slot_ids.dtype}")
    if weights.shape != slot_ids.shape:
        raise ValueError(f"weights shape {tuple(weights.shape)} differs from slot_ids {tuple(slot_ids.shape)}")
