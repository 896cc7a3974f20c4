"""rebalance_experts: the balancer's one entry point (drop-in for DeepSeek EPLB's).

Policies:
  "deepseek"      DeepSeek's greedy algorithm (balancer/deepseek.py);
  "hierarchical"  ours: groups packed to nodes, every replica of a group's experts on
                  its node, replicas packed to the node's GPUs;
  "global"        ours: one domain of all GPUs;
  "auto"          ours, hierarchical when num_groups % num_nodes == 0 (DeepSeek's rule).
As in DeepSeek's reference, "auto" and "deepseek" fall back to the global policy when
num_groups % num_nodes != 0, whatever num_groups is (E % num_groups need not be 0 then).
Given old_phy2log, "deepseek" keeps the experts that stay on a GPU in the slots they
held there (vLLM's DeepSeek policy does the same); the GPU of every copy is DeepSeek's.
Ours differs from DeepSeek's in four ways: replicas of one expert are capped at the
number of GPUs of the domain and do not share a GPU (unless, on a layer, only a shared
GPU lets ours match the reference: two replicas on one GPU are an uneven split of that
expert's load); every greedy packing is refined by a swap local search; given
old_phy2log, bins are relabelled and slots ordered to keep copies in place, and a
"sticky" candidate that starts from the old placement and swaps only until it is
within `stability_tolerance` of the fresh balancedness (never below the reference's)
is taken wherever it gets there; per layer, DeepSeek's own placement is taken wherever
it still balances better, so ours is never worse than the reference; finally, a layer
whose old placement already balances the new load as well as the new one (an idle or
uniform layer) keeps it, copy for copy.
"""

from __future__ import annotations

import numpy as np
import torch

from balancer.balancedness import as_numpy, predict
from balancer.deepseek import domain_experts, rebalance_deepseek
from balancer.packing import (
    greedy_pack,
    pack_dup_free,
    refine_swaps,
    repair_duplicates,
    replicate,
    replicate_cold,
    search_counts,
)
from balancer.placement import compute_log2phy
from balancer.stability import greedy_matching, keep_slots_on_gpu, match_bins, order_in_bins, sticky_bins

POLICIES = ("auto", "hierarchical", "global", "deepseek")
_EPS = 1e-12
# How much better (balancedness) the placement with cold redundant copies (``replicate_cold``) must be
# than the greedy one to be taken: where greedy replication packs worse than no redundancy at all,
# not the window's noise (a steady load would otherwise be repacked window after window).
_COLD_MARGIN = 0.01


def rebalance_experts(
    weight: torch.Tensor | np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    old_phy2log: torch.Tensor | np.ndarray | None = None,
    policy: str = "auto",
    stability_tolerance: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replicate and place experts so that GPU loads balance.

    weight: [L, E] load per logical expert (torch or numpy, any real dtype, >= 0).
    num_replicas: P physical slots per layer, a multiple of num_gpus, >= E.
    num_groups: expert groups (E % num_groups == 0 where the hierarchical policy runs);
    num_nodes divides num_gpus.
    old_phy2log: [L, P] current placement, to keep experts in place ("deepseek": only
    the slot order within each GPU).
    stability_tolerance: balancedness ours may give up per layer to keep copies in
    place (never below the reference's).
    Returns: phy2log [L, P], log2phy [L, E, max_replicas] (-1 padded, slots ascending),
    logcnt [L, E], all int64 CPU tensors; slot p lives on GPU p // (P / num_gpus).
    """
    w = _validate(weight, num_replicas, num_groups, num_nodes, num_gpus, policy)
    if not 0.0 <= stability_tolerance <= 1.0:
        raise ValueError(f"stability_tolerance={stability_tolerance} must be within [0, 1]")
    num_layers, num_experts = w.shape
    old = None
    if old_phy2log is not None:
        old = as_numpy(old_phy2log, "old_phy2log", 2).astype(np.int64)
        if old.shape != (num_layers, num_replicas):
            raise ValueError(f"old_phy2log has shape {old.shape}, expected {(num_layers, num_replicas)}")
        if old.min() < 0 or old.max() >= num_experts:
            raise ValueError(f"old_phy2log holds expert ids outside [0, {num_experts})")
    hierarchical = num_groups % num_nodes == 0 if policy in ("auto", "deepseek") else policy == "hierarchical"
    groups, nodes = (num_groups, num_nodes) if hierarchical else (1, 1)
    # DeepSeek's algorithm on the same family (its global policy is groups = nodes = 1).
    ref = rebalance_deepseek(w, num_replicas, groups, nodes, num_gpus)
    if policy == "deepseek":
        phy = ref if old is None else keep_slots_on_gpu(ref, old, num_gpus)
    else:
        phy = _ours(w, (num_replicas, groups, nodes, num_gpus), old, ref, stability_tolerance)
    phy2log = torch.from_numpy(np.ascontiguousarray(phy, dtype=np.int64))
    log2phy, logcnt = compute_log2phy(phy2log, num_experts)
    return phy2log, log2phy, logcnt


def _validate(weight, num_replicas, num_groups, num_nodes, num_gpus, policy) -> np.ndarray:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
    w = as_numpy(weight, "weight", 2).astype(np.float64)
    num_layers, num_experts = w.shape
    if num_layers == 0 or num_experts == 0:
        raise ValueError(f"weight must be non-empty [L, E], got {w.shape}")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("weight must be finite and non-negative")
    if min(num_groups, num_nodes, num_gpus) <= 0:
        raise ValueError(f"num_groups={num_groups}, num_nodes={num_nodes}, num_gpus={num_gpus} must be positive")
    if num_replicas < num_experts:
        raise ValueError(f"num_replicas={num_replicas} is fewer than the {num_experts} logical experts")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas={num_replicas} is not a multiple of num_gpus={num_gpus}")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus={num_gpus} is not a multiple of num_nodes={num_nodes}")
    hierarchical = num_groups % num_nodes == 0 if policy in ("auto", "deepseek") else policy == "hierarchical"
    if hierarchical and num_experts % num_groups:
        raise ValueError(f"{num_experts} experts cannot form {num_groups} equal groups")
    if policy == "hierarchical" and num_groups % num_nodes:
        raise ValueError(f"hierarchical policy needs num_groups={num_groups} divisible by num_nodes={num_nodes}")
    return w


def _place(w, num_replicas, num_groups, num_nodes, num_gpus, old, max_load, *, allow_dup: bool,
           search: bool = False, cold: bool = False) -> np.ndarray:
    """Our placement; w [L, E] float64, old [L, P] or None -> phy2log [L, P].
    max_load [L] (sticky mode, needs old): start from old and only swap until every
    GPU load is at most this; None: pack afresh, then relabel to overlap old.
    allow_dup: let two replicas of an expert share a GPU (no cap on replicas);
    search: also move replicas between experts (search_counts) in fresh mode.
    cold: give the redundant slots to the coldest experts (``replicate_cold``), not the hottest."""
    num_layers, num_experts = w.shape
    group_size = num_experts // num_groups
    group_weight = w.reshape(num_layers, num_groups, group_size).sum(-1)
    node_max = None if max_load is None else max_load * (num_gpus // num_nodes)
    node_of_group = _pack_groups(group_weight, num_nodes, group_size, old, node_max)
    rank_in = np.zeros_like(node_of_group)
    order = np.argsort(node_of_group, axis=1, kind="stable")
    rank_in_sorted = np.tile(np.arange(num_groups // num_nodes), num_nodes)[None, :].repeat(num_layers, 0)
    np.put_along_axis(rank_in, order, rank_in_sorted, 1)
    experts = domain_experts(node_of_group, rank_in, group_size)  # [L, N, E/N]
    rows = num_layers * num_nodes
    dom_exp = experts.reshape(rows, -1)
    dom_w = np.take_along_axis(w, experts.reshape(num_layers, -1), 1).reshape(rows, -1)
    old_local = None
    if old is not None:
        local_of = np.full((rows, num_experts), -1, dtype=np.int64)
        np.put_along_axis(local_of, dom_exp, np.broadcast_to(np.arange(dom_exp.shape[1]), dom_exp.shape), 1)
        old_local = np.take_along_axis(local_of, old.reshape(rows, -1), 1)
    dom_max = None if max_load is None else np.repeat(max_load, num_nodes)
    slots = _place_domain(dom_w, num_replicas // num_nodes, num_gpus // num_nodes, old_local, dom_max, allow_dup,
                          search, cold)
    return np.take_along_axis(dom_exp, slots, 1).reshape(num_layers, num_replicas)


def _pack_groups(group_weight, num_nodes, group_size, old, max_load) -> np.ndarray:
    """[L, G] -> node_of_group [L, G]: balanced packing, relabelled (or kept) to match old."""
    num_layers, num_groups = group_weight.shape
    if num_nodes == 1:
        return np.zeros((num_layers, num_groups), dtype=np.int64)
    gid = np.broadcast_to(np.arange(num_groups), group_weight.shape)
    old_group = None
    if old is not None:
        old_group = (old // group_size).reshape(num_layers, num_nodes, -1)
        # majority node of each group: count copies per (node, group)
        counts = np.zeros((num_layers, num_nodes, num_groups), dtype=np.int64)
        np.add.at(counts, (np.arange(num_layers)[:, None, None], np.arange(num_nodes)[None, :, None], old_group), 1)
        old_group = counts
    if max_load is not None and old_group is not None:
        init = _sticky_groups(old_group, num_groups // num_nodes)
        return refine_swaps(group_weight, gid, init, num_nodes, target=max_load)
    bins, _ = greedy_pack(group_weight, None, num_nodes)
    bins = refine_swaps(group_weight, gid, bins, num_nodes)
    if old_group is None:
        return bins
    overlap = np.zeros((num_layers, num_nodes, num_nodes), dtype=np.int64)  # [L, new bin, old node]
    np.add.at(overlap, (np.arange(num_layers)[:, None], bins), old_group.transpose(0, 2, 1))
    node_of_bin = np.stack([greedy_matching(overlap[x]) for x in range(num_layers)])
    return np.take_along_axis(node_of_bin, bins, 1)


def _sticky_groups(counts: np.ndarray, per_node: int) -> np.ndarray:
    """counts [L, N, G] old copies per (node, group) -> node_of_group [L, G] with
    per_node groups per node, each group on its majority node while room remains."""
    num_layers, num_nodes, num_groups = counts.shape
    out = np.empty((num_layers, num_groups), dtype=np.int64)
    for x in range(num_layers):
        fill = np.zeros(num_nodes, dtype=np.int64)
        nodes, groups = np.unravel_index(np.argsort(-counts[x], axis=None, kind="stable"), counts[x].shape)
        placed = np.zeros(num_groups, dtype=bool)
        for n, g in zip(nodes.tolist(), groups.tolist()):
            if not placed[g] and fill[n] < per_node:
                out[x, g], placed[g] = n, True
                fill[n] += 1
    return out


def _place_domain(w, num_slots, num_bins, old_local, max_load, allow_dup, search, cold=False) -> np.ndarray:
    """w [X, e] -> slots [X, num_slots] local expert ids, GPU b owning slots b*k..b*k+k-1."""
    num_rows, num_experts = w.shape
    counts, extra = (replicate_cold if cold else replicate)(w, num_slots, max_count=None if allow_dup else num_bins)
    item_expert = np.concatenate([np.broadcast_to(np.arange(num_experts), (num_rows, num_experts)), extra], 1)
    item_weight = np.take_along_axis(w / counts, item_expert, 1)
    sticky = max_load is not None
    if sticky:
        bins = sticky_bins(item_expert, item_weight, old_local, num_bins)
        if not allow_dup:
            bins = repair_duplicates(item_weight, item_expert, bins, num_bins)
        bins = refine_swaps(item_weight, item_expert, bins, num_bins, target=max_load, forbid_dup=not allow_dup)
    elif allow_dup:
        bins, _ = greedy_pack(item_weight, None, num_bins)
        bins = refine_swaps(item_weight, item_expert, bins, num_bins, forbid_dup=False)
    else:
        bins = pack_dup_free(item_weight, item_expert, num_bins)
        if search:
            counts, item_expert, bins = search_counts(w, counts, item_expert, bins, num_bins)
    if old_local is None:
        return order_in_bins(item_expert, bins, np.full_like(item_expert, -1), num_bins)
    if not sticky:
        gpu_of_bin = match_bins(item_expert, bins, old_local, num_bins)
        bins = np.take_along_axis(gpu_of_bin, bins, 1)
    return order_in_bins(item_expert, bins, old_local, num_bins)


def _ours(w, shape, old, ref, tolerance) -> np.ndarray:
    """Per layer: the dup-free placement; one allowing two replicas on a GPU (an
    uneven split of that expert's load) only where the reference beats dup-free;
    the reference's own layer where it still wins. Given old, the sticky candidate
    wherever it reaches max(fresh - tolerance, reference); old itself wherever it
    balances w at least as well as that and fits the policy family. Returns phy2log [L, P]."""
    num_gpus = shape[3]

    def bal(weight, phy):
        return predict(weight, phy, num_gpus).per_layer.numpy()

    def sub(x, rows):
        return None if x is None else x[rows]

    fresh = _place(w, *shape, old, None, allow_dup=False)
    b_fresh, b_ref = bal(w, fresh), bal(w, ref)
    for allow_dup in (False, True):  # dup-free with a replica-count search first
        rows = np.nonzero(b_fresh + _EPS < b_ref)[0]
        if rows.size:
            alt = _place(w[rows], *shape, sub(old, rows), None, allow_dup=allow_dup, search=not allow_dup)
            b_alt = bal(w[rows], alt)
            better = b_alt > b_fresh[rows] + _EPS
            fresh[rows[better]], b_fresh[rows[better]] = alt[better], b_alt[better]
    # redundant slots: the cold copies' packing where it is clearly better (a layer already within the
    # margin of even cannot be)
    rows = np.nonzero(b_fresh < 1.0 - _COLD_MARGIN)[0] if shape[0] > w.shape[1] else np.empty(0, dtype=np.int64)
    if rows.size:
        alt = _place(w[rows], *shape, sub(old, rows), None, allow_dup=False, cold=True)
        b_alt = bal(w[rows], alt)
        better = b_alt > b_fresh[rows] + _COLD_MARGIN
        fresh[rows[better]], b_fresh[rows[better]] = alt[better], b_alt[better]
    worse = b_fresh + _EPS < b_ref
    fresh[worse], b_fresh[worse] = ref[worse], b_ref[worse]
    if old is None:
        return fresh
    goal = np.maximum(b_fresh - tolerance, b_ref)
    # Highest GPU load that still reaches the goal; the sticky search stops there.
    max_load = w.sum(1) / num_gpus / np.maximum(goal, 1e-12) * (1 + 1e-9)
    sticky = _place(w, *shape, old, max_load, allow_dup=False)
    ok = bal(w, sticky) + _EPS >= goal
    rows = np.nonzero(~ok)[0]
    if rows.size:
        alt = _place(w[rows], *shape, old[rows], max_load[rows], allow_dup=True)
        reached = bal(w[rows], alt) + _EPS >= goal[rows]
        sticky[rows[reached]], ok[rows[reached]] = alt[reached], True
    new = np.where(ok[:, None], sticky, fresh)
    # Ties go to the placement in force: an idle or uniform layer has nothing to gain.
    stay = (bal(w, old) + _EPS >= bal(w, new)) & _fits_family(old, shape, w.shape[1])
    return np.where(stay[:, None], old, new)


def _fits_family(old: np.ndarray, shape: tuple, num_experts: int) -> np.ndarray:
    """Per layer, whether old is a placement of our policy family: every expert has a copy
    and each group's copies sit on one node (hierarchical). old: [L, P] -> [L] bool.
    (Two copies of an expert on one GPU are allowed: staying is only taken where old
    balances the load as well as the new placement.)"""
    num_replicas, num_groups, num_nodes, _ = shape
    num_layers = old.shape[0]
    layer = np.arange(num_layers)[:, None]
    counts = np.zeros((num_layers, num_experts), dtype=np.int64)
    np.add.at(counts, (layer, old), 1)
    ok = (counts > 0).all(1)
    if num_nodes > 1:
        node = np.broadcast_to(np.arange(num_replicas) // (num_replicas // num_nodes), old.shape)
        on_node = np.zeros((num_layers, num_groups, num_nodes), dtype=bool)
        on_node[layer, old // (num_experts // num_groups), node] = True
        ok &= (on_node.sum(-1) <= 1).all(1)
    return ok
