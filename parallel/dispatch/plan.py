"""Pure planning for the deduplicated AllToAll-v: which rows go where, their wire format, and
how the returned partial rows are summed back into tokens.

Shape legend: T tokens on this rank, D hidden, K top-k, R EP ranks, N (token,
destination rank) pairs sent, M pairs received.

A token is sent once per destination rank, however many of its top-k slots live there
(DeepEP-style dedup). Each sent row carries the token's hidden vector plus its whole
K-wide assignment list (physical slot, weight); the destination keeps the columns whose
slot it hosts (``localize_slots``), so the source builds no per-destination metadata.
The destination sums the weighted expert outputs of those columns and sends one row back.

Wire format of one dispatched row (one uint8 buffer, one collective):
``[hidden: D * itemsize bytes, padded to 8 | physical slots: K int32 | weights: K float32]``.

Sort-free plan: one dense [R, T] "token t goes to rank r" mask gives the send order
(rank-major, tokens ascending) by a cumulative sum, and its transpose gives the combine
order (token-major), so the source sums each token's returned rows with one
``embedding_bag`` (gather + sum, fp32 accumulation) instead of a zero-fill and atomics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DispatchPlan:
    """Rows to send, grouped by destination EP rank (ascending), tokens ascending inside.

    pair_token: [N] int64 source token of each row; send_counts: R ints (rows per rank);
    combine_index: [N] int64 the same rows listed token-major (a token's rows in rank order);
    combine_offsets: [T] int64 start of token t's rows in combine_index (``embedding_bag``
    offsets; a token with no row, all assignments dropped, has an empty range).
    """

    pair_token: torch.Tensor
    send_counts: list[int]
    combine_index: torch.Tensor
    combine_offsets: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.pair_token.numel()


def compute_dispatch_plan(slot_ids: torch.Tensor, num_local_slots: int, num_ranks: int) -> DispatchPlan:
    """slot_ids: [T, K] int physical slots (-1 dropped), slot p on rank p // num_local_slots.
    Returns the deduplicated ``DispatchPlan``."""
    return plan_from_mask(destination_mask(slot_ids, num_local_slots, num_ranks))


def destination_mask(slot_ids: torch.Tensor, num_local_slots: int, num_ranks: int) -> torch.Tensor:
    """slot_ids: [T, K] int physical slots (-1 dropped). Returns [R, T] bool: token t has at
    least one assignment on rank r. ``mask.sum(1)`` are the rows sent to each rank, known
    before the rest of the plan so the count exchange can start early."""
    num_tokens = slot_ids.shape[0]
    num_slots = num_local_slots * num_ranks
    if slot_ids.numel():
        lo, hi = torch.aminmax(slot_ids)
        if int(hi) >= num_slots or int(lo) < -1:
            bad = int(hi) if int(hi) >= num_slots else int(lo)
            raise ValueError(f"slot id {bad} out of range: {num_ranks} ranks x {num_local_slots} local slots")
    dest = torch.div(slot_ids.long(), num_local_slots, rounding_mode="floor")  # [T, K], -1 stays -1
    token = torch.arange(num_tokens, device=slot_ids.device).unsqueeze(1)
    key = (dest * num_tokens + token).masked_fill_(slot_ids < 0, num_ranks * num_tokens)  # dropped: spare cell
    mask = torch.zeros(num_ranks * num_tokens + 1, dtype=torch.bool, device=slot_ids.device)
    mask.index_fill_(0, key.view(-1), True)
    mask = mask[:-1].view(num_ranks, num_tokens)
    return mask


def plan_from_mask(mask: torch.Tensor) -> DispatchPlan:
    """mask: [R, T] bool from ``destination_mask``. Returns the ``DispatchPlan``: one row per
    True entry, rank-major (the send order), and the token-major view of the same rows."""
    num_ranks, num_tokens = mask.shape
    flat = torch.nonzero(mask.view(-1), as_tuple=False).squeeze(1)
    pair_token = flat % max(num_tokens, 1)
    row_id = (torch.cumsum(mask.view(-1), 0) - 1).view(num_ranks, num_tokens)  # row of (r, t) where True
    mask_t = mask.t()  # [T, R]
    combine_index = row_id.t()[mask_t]  # token-major
    rows_per_token = mask_t.sum(1)
    combine_offsets = torch.cumsum(rows_per_token, 0) - rows_per_token
    return DispatchPlan(pair_token, mask.sum(1).tolist(), combine_index, combine_offsets)


def row_layout(hidden_size: int, top_k: int, dtype: torch.dtype) -> tuple[int, int]:
    """(hidden bytes padded to 8, total row bytes) of the dispatch wire format."""
    hidden_bytes = hidden_size * dtype.itemsize
    hidden_bytes = (hidden_bytes + 7) // 8 * 8
    return hidden_bytes, hidden_bytes + 8 * top_k


def pack_rows(
    x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, plan: DispatchPlan,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, D]; slot_ids: [T, K] int; weights: [T, K] float. Returns the send buffer
    [N, row_bytes] uint8 (two row gathers: hidden, then the [T, 2K] metadata), written
    into ``out`` when given (a reused buffer of that shape)."""
    hidden_size, top_k = x.shape[1], slot_ids.shape[1]
    hidden_bytes, row_bytes = row_layout(hidden_size, top_k, x.dtype)
    shape = (plan.num_rows, row_bytes)
    if out is not None and (tuple(out.shape) != shape or out.dtype != torch.uint8):
        raise ValueError(f"pack_rows out must be {shape} uint8, got {tuple(out.shape)} {out.dtype}")
    buf = torch.empty(shape, dtype=torch.uint8, device=x.device) if out is None else out
    nbytes = hidden_size * x.element_size()
    # gather 8-byte words when the row allows it (fewer, wider element copies)
    word = torch.int64 if nbytes % 8 == 0 and x.is_contiguous() else x.dtype
    torch.index_select(x.view(word), 0, plan.pair_token, out=buf[:, :nbytes].view(word))
    meta = torch.cat([slot_ids.to(torch.int32), weights.to(torch.float32).view(torch.int32)], dim=1)  # [T, 2K]
    torch.index_select(meta, 0, plan.pair_token, out=buf[:, hidden_bytes:].view(torch.int32))
    return buf


def pack_token_rows(x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x: [T, D]; slot_ids: [T, K] int; weights: [T, K] float. Returns every token's row of the wire
    format in token order, [T, row_bytes] uint8 (a new tensor; ``unpack_rows`` reads it)."""
    hidden_size, top_k = x.shape[1], slot_ids.shape[1]
    hidden_bytes, row_bytes = row_layout(hidden_size, top_k, x.dtype)
    buf = torch.empty((x.shape[0], row_bytes), dtype=torch.uint8, device=x.device)
    buf[:, : hidden_size * x.element_size()].view(x.dtype).copy_(x)
    buf[:, hidden_bytes : hidden_bytes + 4 * top_k].view(torch.int32).copy_(slot_ids)
    buf[:, hidden_bytes + 4 * top_k :].view(torch.float32).copy_(weights)
    return buf


def unpack_rows(
    buf: torch.Tensor, hidden_size: int, top_k: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """buf: [M, row_bytes] uint8. Returns views (x [M, D] dtype, physical slots [M, K] int32,
    weights [M, K] float32) into ``buf``."""
    hidden_bytes, row_bytes = row_layout(hidden_size, top_k, dtype)
    if buf.dim() != 2 or buf.shape[1] != row_bytes:
        raise ValueError(f"dispatch buffer must be [M, {row_bytes}] uint8, got {tuple(buf.shape)}")
    nbytes = hidden_size * dtype.itemsize
    x = buf[:, :nbytes].view(dtype)
    slots = buf[:, hidden_bytes : hidden_bytes + 4 * top_k].view(torch.int32)
    weights = buf[:, hidden_bytes + 4 * top_k :].view(torch.float32)
    return x, slots, weights


def localize_slots(slots: torch.Tensor, rank: int, num_local_slots: int) -> torch.Tensor:
    """slots: [M, K] int physical slots. Returns [M, K] int64 local slot ids on ``rank``, -1
    for slots hosted elsewhere and for dropped (-1) assignments."""
    local = slots.to(torch.int64) - rank * num_local_slots
    return local.masked_fill_((local < 0) | (local >= num_local_slots), -1)


def combine_rows(back: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """back: [N, D] one weighted partial row per sent row (send order). Returns [T, D] float32,
    each token's rows summed with fp32 accumulation (one gather + sum, no zero-fill; a token
    without rows gets zeros). For 16-bit rows the fp32 sum is rounded once to that dtype
    before widening, as the rows themselves were on the wire."""
    if back.shape[0] != plan.num_rows:
        raise ValueError(f"combine got {back.shape[0]} rows for a plan of {plan.num_rows}")
    summed = F.embedding_bag(plan.combine_index, back, plan.combine_offsets, mode="sum")
    if summed.dtype == torch.float32:
        return summed
    return torch.empty(summed.shape, dtype=torch.float32, device=summed.device).copy_(summed)


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
