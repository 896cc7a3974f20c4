"""Vectorised replication and bin packing, shared by every placement policy.

Shape legend: X independent rows (layers, or layer x node domains), n items per
row (physical replicas), m bins per row (GPUs), k = n / m items per bin,
e logical experts per row.

Every function works on all X rows at once with numpy; Python loops run over
item positions or search iterations, never over rows.
"""

from __future__ import annotations

import numpy as np
import torch


def _one_replica_each(weight: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where the replications start: counts [X, e] all 1, extra [X, num_slots - e] to fill, the row
    indices [X]; ValueError when num_slots < e."""
    num_rows, num_experts = weight.shape
    if num_slots < num_experts:
        raise ValueError(f"num_slots={num_slots} is fewer than the {num_experts} experts to place")
    counts = np.ones((num_rows, num_experts), dtype=np.int64)
    return counts, np.empty((num_rows, num_slots - num_experts), dtype=np.int64), np.arange(num_rows)


def replicate(weight: np.ndarray, num_slots: int, max_count: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Greedily give the `num_slots - e` redundant slots to the experts with the
    highest load per replica (this minimises the maximum per-replica load).

    weight: [X, e] float; num_slots >= e; max_count caps the replicas of one expert
    (replicas beyond the number of GPUs cannot spread the load further); the cap is
    lifted for a row only when every expert already sits at it.
    Returns: counts [X, e] int64 (>= 1, rows sum to num_slots) and
    extra [X, num_slots - e] int64, the expert given each redundant slot, in the
    order they were given.
    """
    counts, extra, rows = _one_replica_each(weight, num_slots)
    # Load per replica, and the same with experts at the cap masked; only the picked
    # expert's entry changes per round.
    score = weight / counts.astype(weight.dtype)
    capped = score.copy()
    if max_count is not None:
        capped[counts >= max_count] = -np.inf
    for t in range(extra.shape[1]):
        pick = capped.argmax(axis=1)
        if max_count is not None:
            full = np.isneginf(capped[rows, pick])  # every expert at the cap: the cap is lifted
            if full.any():
                pick[full] = score[full].argmax(axis=1)
        extra[:, t] = pick
        counts[rows, pick] += 1
        score[rows, pick] = weight[rows, pick] / counts[rows, pick].astype(weight.dtype)
        capped[rows, pick] = score[rows, pick]
        if max_count is not None:
            capped[rows, pick] = np.where(counts[rows, pick] >= max_count, -np.inf, score[rows, pick])
    return counts, extra


def replicate_cold(weight: np.ndarray, num_slots: int, max_count: int | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``replicate``'s shape with the redundant slots given, one at a time, to the expert of the
    *lowest* load per replica below ``max_count`` (the cap is lifted for a row only when every expert
    sits at it): a copy of an idle expert weighs nothing, any copy only splits its expert's load, so
    the experts pack much as they would without redundant slots.

    Greedy replication minimises the largest replica, not the largest GPU: on few GPUs its copies of
    the hottest experts, one per GPU, can pack worse than no redundant slots at all (loads 32, 23, 9
    on two GPUs: 32 | 23 + 9 is even; with two redundant slots 16 + 16 and 11.5 + 11.5 go one to each
    GPU and 9 tips it). weight: [X, e] float; num_slots >= e. Returns (counts [X, e] >= 1, rows
    summing to num_slots; extra [X, num_slots - e], the expert given each redundant slot).
    """
    counts, extra, rows = _one_replica_each(weight, num_slots)
    for t in range(extra.shape[1]):
        score = weight / counts.astype(weight.dtype)
        if max_count is not None:
            capped = np.where(counts >= max_count, np.inf, score)
            full = np.isposinf(capped).all(1)
            score = np.where(full[:, None], score, capped)
        pick = score.argmin(axis=1)
        extra[:, t] = pick
        counts[rows, pick] += 1
    return counts, extra


def greedy_pack(
    item_weight: np.ndarray, item_expert: np.ndarray | None, num_bins: int, *, torch_order: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Longest-processing-time packing with exactly n / m items per bin.

    Items go heaviest first (stable order) to the lightest bin that still has room;
    with item_expert given, a bin already holding that expert is avoided while
    another bin with room exists.
    item_weight: [X, n] float; item_expert: [X, n] int64 in [0, e) or None.
    torch_order: order ties as torch.sort(descending=True) does (DeepSeek's reference).
    Returns: bin_of_item [X, n] int64 in [0, m), rank_in_bin [X, n] int64 in [0, k)
    (the order items entered their bin).
    """
    num_rows, n = item_weight.shape
    per_bin = n // num_bins
    rows = np.arange(num_rows)
    if torch_order:
        order = torch.from_numpy(np.ascontiguousarray(item_weight)).sort(-1, descending=True).indices.numpy()
    else:
        order = np.argsort(-item_weight, axis=1, kind="stable")
    loads = np.zeros((num_rows, num_bins), dtype=item_weight.dtype)
    avail = loads.copy()  # loads, inf where the bin is full
    fill = np.zeros((num_rows, num_bins), dtype=np.int64)
    bin_of = np.empty((num_rows, n), dtype=np.int64)
    rank_of = np.empty((num_rows, n), dtype=np.int64)
    weight_in_order = np.take_along_axis(item_weight, order, 1)
    has = expert_in_order = None
    if item_expert is not None:
        has = np.zeros((num_rows, int(item_expert.max()) + 1, num_bins), dtype=bool)  # [X, e, m]
        expert_in_order = np.take_along_axis(item_expert, order, 1)
    for t in range(n):
        item = order[:, t]
        if has is None:
            b = avail.argmin(axis=1)
        else:
            expert = expert_in_order[:, t]
            no_dup = np.where(has[rows, expert], np.inf, avail)
            b = no_dup.argmin(axis=1)
            stuck = np.isinf(no_dup[rows, b])  # every bin with room holds the expert: allow a duplicate
            if stuck.any():
                b[stuck] = avail[stuck].argmin(axis=1)
            has[rows, expert, b] = True
        bin_of[rows, item] = b
        rank_of[rows, item] = fill[rows, b]
        loads[rows, b] += weight_in_order[:, t]
        fill[rows, b] += 1
        avail[rows, b] = np.where(fill[rows, b] >= per_bin, np.inf, loads[rows, b])
    return bin_of, rank_of


def members_of(bin_of: np.ndarray, num_bins: int) -> np.ndarray:
    """bin_of [X, n] -> members [X, m, k]: item indices of each bin, ascending."""
    num_rows, n = bin_of.shape
    return np.argsort(bin_of, axis=1, kind="stable").reshape(num_rows, num_bins, n // num_bins)


def refine_swaps(
    item_weight: np.ndarray,
    item_expert: np.ndarray,
    bin_of: np.ndarray,
    num_bins: int,
    max_iters: int | None = None,
    target: np.ndarray | None = None,
    forbid_dup: bool = True,
) -> np.ndarray:
    """Local search: repeatedly apply the swap between the most loaded bin and any
    other bin that lowers the larger of the two loads the most. Stops for a row when
    no swap lowers its maximum bin load. Never creates a duplicate expert in a bin.

    item_weight: [X, n]; item_expert: [X, n] int64; bin_of: [X, n] initial bins;
    target: [X] optional; a row stops once its maximum bin load is at most this
    (fewer swaps, fewer moved copies, when starting from an old placement);
    forbid_dup: False lets a swap put a second replica of an expert on a bin.
    Returns: bin_of [X, n] with each bin still holding exactly k items; per row the
    maximum bin load is never higher than the initial one.
    """
    num_rows, n = item_weight.shape
    k = n // num_bins
    if num_bins == 1 or n == num_bins:
        return bin_of.copy()
    members = members_of(bin_of, num_bins)
    num_experts = int(item_expert.max()) + 1
    # Per-bin copies of the items' weights and experts, swapped along with members.
    member_weight = np.take_along_axis(item_weight, members.reshape(num_rows, -1), 1).reshape(members.shape)
    member_expert = np.take_along_axis(item_expert, members.reshape(num_rows, -1), 1).reshape(members.shape)
    has = None
    if forbid_dup:
        flat = (np.arange(num_rows)[:, None, None] * num_bins + np.arange(num_bins)[None, :, None]) * num_experts
        has = np.bincount((flat + member_expert).ravel(), minlength=num_rows * num_bins * num_experts)
        has = has.reshape(num_rows, num_bins, num_experts).astype(np.int32)
    # Work buffers for the [A, k, m, k] swap scores, reused every step (fresh
    # temporaries of this size cost more in page faults than in arithmetic).
    size = num_rows * k * num_bins * k
    work = (np.empty(size), np.empty(size))
    active = np.arange(num_rows)
    iters = max_iters if max_iters is not None else 4 * n
    for _ in range(iters):
        if active.size == 0:
            break
        active = _swap_step(member_weight, member_expert, members, has, active, target, work)
    out = np.empty_like(bin_of)
    np.put_along_axis(out, members.reshape(num_rows, -1),
                      np.repeat(np.arange(num_bins), k)[None, :].repeat(num_rows, 0), 1)
    return out


def _swap_step(member_weight, member_expert, members, has, active, target, work) -> np.ndarray:
    """One improving swap for each active row (in place on members, member_weight,
    member_expert [X, m, k] and has [X, m, e]); returns the rows still improving.
    work: two float buffers of >= X * k * m * k elements."""
    a = active.size
    num_bins, k = members.shape[1:]
    shape = (a, k, num_bins, k)
    d, score = (buf[:a * k * num_bins * k].reshape(shape) for buf in work)
    ar = np.arange(a)
    whole = a == members.shape[0]
    w = member_weight if whole else member_weight[active]  # [A, m, k]
    loads = w.sum(-1)  # [A, m]
    hot = loads.argmax(1)
    top = loads[ar, hot]
    # Swap item i of the hot bin with item j of bin o: d = w_i - w_j, new loads top - d and
    # load_o + d. Swaps with d <= 0 or inside the hot bin score >= top, so they never win.
    np.subtract(w[ar, hot][:, :, None, None], w[:, None, :, :], out=d)  # [A, k(hot), m, k]
    np.subtract(top[:, None, None, None], d, out=score)
    np.add(loads[:, None, :, None], d, out=d)
    np.maximum(score, d, out=score)
    if has is not None:  # no swap may put a second copy of an expert on a bin
        num_experts = has.shape[2]
        ex = member_expert if whole else member_expert[active]
        base = active[:, None, None] * num_bins
        ex_hot = ex[ar, hot][:, :, None]  # [A, k, 1]
        in_other = np.take(has, (base + np.arange(num_bins)[None, None, :]) * num_experts + ex_hot)  # [A, k, m]
        in_hot = np.take(has, (base + hot[:, None, None]) * num_experts + ex)  # [A, m, k]
        np.copyto(score, np.inf, where=(in_other > 0)[:, :, :, None])
        np.copyto(score, np.inf, where=(in_hot > 0)[:, None, :, :])
    flat = score.reshape(a, -1)
    best = flat.argmin(1)
    gain = flat[ar, best] < top - 1e-9 * np.maximum(top, 1e-30)
    if target is not None:
        gain &= top > target[active]
    rows = np.nonzero(gain)[0]
    if rows.size == 0:
        return active[:0]
    i, rest = np.divmod(best[rows], num_bins * k)
    other, j = np.divmod(rest, k)
    glob = active[rows]
    hb = hot[rows]
    for arr in (members, member_weight, member_expert):
        x_i = arr[glob, hb, i]
        arr[glob, hb, i] = arr[glob, other, j]
        arr[glob, other, j] = x_i
    if has is None:
        return glob
    ei, ej = member_expert[glob, other, j], member_expert[glob, hb, i]  # after the swap
    np.add.at(has, (glob, hb, ei), -1)
    np.add.at(has, (glob, other, ei), 1)
    np.add.at(has, (glob, other, ej), -1)
    np.add.at(has, (glob, hb, ej), 1)
    return glob


def repair_duplicates(item_weight: np.ndarray, item_expert: np.ndarray, bin_of: np.ndarray,
                      num_bins: int) -> np.ndarray:
    """Swap away duplicates the greedy could not avoid (it can run out of room near
    the end). For each duplicate, the swap with another bin that creates no new
    duplicate and keeps the larger of the two loads lowest. Rows without duplicates
    are untouched. Shapes as in refine_swaps; returns a new bin_of [X, n]."""
    out = bin_of.copy()
    num_rows, n = bin_of.shape
    key = out * (int(item_expert.max()) + 1) + item_expert
    srt = np.sort(key, 1)
    for x in np.nonzero((srt[:, 1:] == srt[:, :-1]).any(1))[0]:
        _repair_row(item_weight[x], item_expert[x], out[x], num_bins)
    return out


def _repair_row(weight: np.ndarray, expert: np.ndarray, bin_of: np.ndarray, num_bins: int) -> None:
    for _ in range(bin_of.size):
        load = np.bincount(bin_of, weights=weight, minlength=num_bins)
        holds = np.zeros((num_bins, int(expert.max()) + 1), dtype=np.int64)
        np.add.at(holds, (bin_of, expert), 1)
        dup = np.argwhere(holds > 1)
        if dup.size == 0:
            return
        b, e = dup[0]
        i = np.nonzero((bin_of == b) & (expert == e))[0][0]
        j_all = np.nonzero((bin_of != b) & (holds[bin_of, e] == 0) & (holds[b, expert] == 0))[0]
        if j_all.size == 0:
            return
        d = weight[i] - weight[j_all]
        cost = np.maximum(load[b] - d, load[bin_of[j_all]] + d)
        j = j_all[np.argmin(cost)]
        bin_of[i], bin_of[j] = bin_of[j], b


def items_of_counts(weight: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """weight [X, e], counts [X, e] (rows sum to n) -> (item_expert [X, n] ascending,
    item_weight [X, n] = weight / count of the item's expert)."""
    n = int(counts[0].sum())
    ends = np.cumsum(counts, 1)  # [X, e]
    item_expert = (np.arange(n)[None, :, None] >= ends[:, None, :]).sum(-1)
    return item_expert, np.take_along_axis(weight / counts, item_expert, 1)


def pack_dup_free(item_weight: np.ndarray, item_expert: np.ndarray, num_bins: int,
                  target: np.ndarray | None = None) -> np.ndarray:
    """Greedy packing avoiding duplicates, repaired, then refined. Returns bin_of [X, n]."""
    bins, _ = greedy_pack(item_weight, item_expert, num_bins)
    bins = repair_duplicates(item_weight, item_expert, bins, num_bins)
    return refine_swaps(item_weight, item_expert, bins, num_bins, target=target)


def search_counts(weight: np.ndarray, counts: np.ndarray, item_expert: np.ndarray, bin_of: np.ndarray,
                  num_bins: int, max_iters: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Move replicas between experts while that lowers a row's maximum bin load.

    The greedy replication minimises the largest *replica*, not the largest *bin*:
    with replicas capped at one per bin, two hot experts may be forced to share a bin.
    Each round gives the heaviest expert of the hottest bin one more replica, taken
    from the expert that loses least by giving one up, and repacks; rows keep the
    change only when their maximum drops.
    weight, counts: [X, e]; item_expert, bin_of: [X, n] the items (counts[x, j] of expert j)
    and their bins. Returns: (counts, item_expert, bin_of) of the best packing per row.
    """
    rows = np.arange(weight.shape[0])
    item_weight = np.take_along_axis(weight / counts, item_expert, 1)
    best = bin_loads(item_weight, bin_of, num_bins).max(1)
    counts, item_expert, bin_of = counts.copy(), item_expert.copy(), bin_of.copy()
    for _ in range(max_iters):
        hot = bin_loads(item_weight, bin_of, num_bins).argmax(1)
        on_hot = np.where(bin_of == hot[:, None], item_weight, -np.inf)
        heavy = item_expert[rows, on_hot.argmax(1)]
        give = np.where(counts >= 2, weight / np.maximum(counts - 1, 1), np.inf)
        give[rows, heavy] = np.inf
        donor = give.argmin(1)
        valid = np.isfinite(give[rows, donor]) & (counts[rows, heavy] < num_bins)
        if not valid.any():
            break
        trial = counts.copy()
        trial[rows[valid], heavy[valid]] += 1
        trial[rows[valid], donor[valid]] -= 1
        t_expert, t_weight = items_of_counts(weight, trial)
        t_bins = pack_dup_free(t_weight, t_expert, num_bins)
        t_max = bin_loads(t_weight, t_bins, num_bins).max(1)
        keep = valid & (t_max < best * (1 - 1e-9))
        if not keep.any():
            break
        counts[keep], item_expert[keep], item_weight[keep] = trial[keep], t_expert[keep], t_weight[keep]
        bin_of[keep], best[keep] = t_bins[keep], t_max[keep]
    return counts, item_expert, bin_of


def bin_loads(item_weight: np.ndarray, bin_of: np.ndarray, num_bins: int) -> np.ndarray:
    """item_weight [X, n], bin_of [X, n] -> loads [X, m]."""
    loads = np.zeros((item_weight.shape[0], num_bins), dtype=np.float64)
    np.add.at(loads, (np.arange(item_weight.shape[0])[:, None], bin_of), item_weight)
    return loads
