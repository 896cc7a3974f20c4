"""Keeping experts where they already are.

A copy that stays on its GPU costs no transfer. Three tools, each over X rows
(domains) of n slots on m GPUs, with experts as row-local ids:
  match_bins: which GPU each freshly packed bin should become (bins are
    interchangeable, so pick the labelling that overlaps the old placement most);
  order_in_bins: put each GPU's experts back in the slots they held before;
  sticky_bins: start from the old placement, keep every copy the new replica counts
    allow, and place only the rest (the caller then refines with swaps).
"""

from __future__ import annotations

import numpy as np

from balancer.packing import members_of


def _old_has(old_local: np.ndarray, num_bins: int, num_experts: int) -> np.ndarray:
    """old_local [X, n] (-1: an expert from outside the domain) -> [X, m, e] counts."""
    num_rows, n = old_local.shape
    has = np.zeros((num_rows, num_bins, num_experts + 1), dtype=np.int64)
    gpu = np.broadcast_to(np.arange(n) // (n // num_bins), old_local.shape)
    np.add.at(has, (np.arange(num_rows)[:, None], gpu, np.where(old_local < 0, num_experts, old_local)), 1)
    return has[:, :, :num_experts]


def match_bins(item_expert: np.ndarray, bin_of: np.ndarray, old_local: np.ndarray, num_bins: int) -> np.ndarray:
    """Relabel bins to GPUs maximising the copies already in place (greedy matching
    on the overlap counts, largest first; ties to the lowest ids).

    item_expert, bin_of, old_local: [X, n]. Returns: gpu_of_bin [X, m] int64, a permutation per row.
    """
    num_rows, n = item_expert.shape
    num_experts = int(max(item_expert.max(), old_local.max())) + 1
    has = _old_has(old_local, num_bins, num_experts) > 0  # [X, m(old gpu), e]
    members = members_of(bin_of, num_bins)  # [X, m, k]
    exp = np.take_along_axis(item_expert, members.reshape(num_rows, -1), 1)  # [X, n] by bin
    hit = np.take_along_axis(has, exp[:, None, :].repeat(num_bins, 1), 2)  # [X, m(gpu), n]
    overlap = hit.reshape(num_rows, num_bins, num_bins, -1).sum(-1).transpose(0, 2, 1)  # [X, bin, gpu]
    out = np.empty((num_rows, num_bins), dtype=np.int64)
    for x in range(num_rows):
        out[x] = greedy_matching(overlap[x])
    return out


def greedy_matching(overlap: np.ndarray) -> np.ndarray:
    """overlap [m, m] -> gpu_of_bin [m]: heaviest pairs first, then leftovers in order."""
    m = overlap.shape[0]
    bins, gpus = np.nonzero(overlap)
    order = np.lexsort((gpus, bins, -overlap[bins, gpus]))
    gpu_of = np.full(m, -1, dtype=np.int64)
    taken = np.zeros(m, dtype=bool)
    for b, g in zip(bins[order].tolist(), gpus[order].tolist()):
        if gpu_of[b] < 0 and not taken[g]:
            gpu_of[b] = g
            taken[g] = True
    gpu_of[gpu_of < 0] = np.nonzero(~taken)[0]
    return gpu_of


def order_in_bins(item_expert: np.ndarray, gpu_of_item: np.ndarray, old_local: np.ndarray,
                  num_bins: int) -> np.ndarray:
    """Slot layout keeping old positions: an expert that held slot j of its GPU keeps
    slot j; the others fill the free slots in item order.

    item_expert, gpu_of_item, old_local: [X, n]. Returns: slots [X, n] local expert per slot.
    """
    num_rows, n = item_expert.shape
    k = n // num_bins
    members = members_of(gpu_of_item, num_bins)  # [X, m, k]
    exp = np.take_along_axis(item_expert, members.reshape(num_rows, -1), 1).reshape(members.shape)
    old = old_local.reshape(num_rows, num_bins, k)
    taken = np.zeros_like(old, dtype=bool)
    pos = np.full(exp.shape, -1, dtype=np.int64)
    rows, bins = np.indices((num_rows, num_bins))
    for i in range(k):
        match = (exp[:, :, i:i + 1] == old) & ~taken  # [X, m, k(pos)]
        found = match.any(-1)
        first = match.argmax(-1)
        pos[:, :, i] = np.where(found, first, -1)
        taken[rows[found], bins[found], first[found]] = True
    free = np.argsort(taken, axis=-1, kind="stable")  # free positions first, ascending
    unplaced = pos < 0
    nth = np.cumsum(unplaced, -1) - 1
    pos = np.where(unplaced, np.take_along_axis(free, np.maximum(nth, 0), -1), pos)
    slots = np.empty((num_rows, num_bins, k), dtype=np.int64)
    np.put_along_axis(slots, pos, exp, -1)
    return slots.reshape(num_rows, n)


def sticky_bins(item_expert: np.ndarray, item_weight: np.ndarray, old_local: np.ndarray,
                num_bins: int) -> np.ndarray:
    """Initial bins that keep old copies: replica r of expert x goes to the GPU of the
    r-th old copy of x (old slot order, one per GPU) while x still has old copies;
    the remaining replicas go heaviest first to the lightest GPU with room that
    does not hold x yet.

    item_expert, item_weight, old_local: [X, n]. Returns: bin_of [X, n] int64.
    """
    num_rows, n = item_expert.shape
    k = n // num_bins
    num_experts = int(max(item_expert.max(), old_local.max())) + 1
    rows = np.arange(num_rows)
    # Homes: the distinct GPUs holding each expert in old, ascending (= old slot order).
    gpu = np.broadcast_to(np.arange(n) // k, old_local.shape)
    valid = old_local >= 0
    row_of = np.broadcast_to(rows[:, None], old_local.shape)
    pairs = np.unique(((row_of * num_experts + old_local) * num_bins + gpu)[valid])  # sorted (row, expert, gpu)
    owner = pairs // num_bins  # row * E + expert
    count = np.bincount(owner, minlength=num_rows * num_experts)
    start = np.cumsum(count) - count
    # Replica r of an expert (r-th in item order) goes to its r-th home while there is one.
    gid = (rows[:, None] * num_experts + item_expert).ravel()
    order = np.argsort(gid, kind="stable")
    first = np.searchsorted(gid[order], gid[order])
    occurrence = np.empty(gid.size, dtype=np.int64)
    occurrence[order] = np.arange(gid.size) - first
    placed = occurrence < count[gid]
    home = np.full(gid.size, -1, dtype=np.int64)
    home[placed] = pairs[start[gid[placed]] + occurrence[placed]] % num_bins
    bin_of = home.reshape(num_rows, n)
    placed = placed.reshape(num_rows, n)
    fill = np.zeros((num_rows, num_bins), dtype=np.int64)
    load = np.zeros((num_rows, num_bins), dtype=np.float64)
    held = np.zeros((num_rows, num_bins, num_experts), dtype=bool)
    r_idx, i_idx = np.nonzero(placed)  # row-major: each GPU's load sums its items in item order
    np.add.at(fill, (r_idx, bin_of[r_idx, i_idx]), 1)
    np.add.at(load, (r_idx, bin_of[r_idx, i_idx]), item_weight[r_idx, i_idx])
    held[r_idx, bin_of[r_idx, i_idx], item_expert[r_idx, i_idx]] = True
    # The rest, heaviest first (stable), each to the lightest GPU with room not holding its expert.
    by_weight = np.argsort(-item_weight, axis=1, kind="stable")
    rest_first = np.argsort(np.take_along_axis(placed, by_weight, 1), axis=1, kind="stable")
    rest = np.take_along_axis(by_weight, rest_first, 1)
    num_rest = (~placed).sum(1)
    for t in range(int(num_rest.max(initial=0))):
        live = np.nonzero(num_rest > t)[0]
        item = rest[live, t]
        expert = item_expert[live, item]
        cand = np.where(fill[live] >= k, np.inf, load[live])
        no_dup = np.where(held[live, :, expert], np.inf, cand)
        cand = np.where(np.isinf(no_dup).all(axis=1, keepdims=True), cand, no_dup)
        g = cand.argmin(axis=1)
        bin_of[live, item] = g
        fill[live, g] += 1
        load[live, g] += item_weight[live, item]
        held[live, g, expert] = True
    return bin_of


def keep_slots_on_gpu(new: np.ndarray, old: np.ndarray, num_gpus: int) -> np.ndarray:
    """Reorder each GPU's slots of new so that an expert it held in old keeps that slot.

    new, old: phy2log [L, P]. Returns: [L, P] with the same experts on every GPU as new.
    """
    gpu_of = np.broadcast_to(np.arange(new.shape[1]) // (new.shape[1] // num_gpus), new.shape)
    return order_in_bins(new, np.ascontiguousarray(gpu_of), old, num_gpus)
