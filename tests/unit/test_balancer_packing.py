"""The vectorised packing kernels against plain per-row references (same results, ties included).

refine_swaps, greedy_pack and sticky_bins are rewritten for speed (rebalance_from_history
calls them every check); these references spell out the rule each one implements, one
row at a time, and the fast versions must give the identical answer.
"""

from __future__ import annotations

import numpy as np
import pytest

from balancer.balancedness import compute_par
from balancer.packing import greedy_pack, refine_swaps, replicate
from balancer.stability import sticky_bins


def _problem(rng, rows, bins, per_bin, ties):
    n = bins * per_bin
    experts = int(rng.integers(max(1, n // 3), n + 1))
    item_expert = np.concatenate([np.broadcast_to(np.arange(experts), (rows, experts)),
                                  rng.integers(0, experts, (rows, n - experts))], 1)
    weight = rng.lognormal(0.0, 1.0, (rows, n))
    if ties:
        weight = np.round(weight * 2) / 2
    return item_expert, weight


def _refine_row(weight, expert, bin_of, m, target, forbid_dup):
    """Swap the hot bin's item i with item j of bin o (first best in (i, o, j) order of the
    bins' ascending members) while the larger of the two loads drops."""
    bin_of = bin_of.copy()
    k = bin_of.size // m
    members = [sorted(np.nonzero(bin_of == b)[0].tolist()) for b in range(m)]
    for _ in range(4 * bin_of.size):
        loads = [float(np.sum(weight[members[b]])) for b in range(m)]
        hot = int(np.argmax(loads))
        top = loads[hot]
        if target is not None and top <= target:
            break
        best, best_score = None, np.inf
        for i in range(k):
            for o in range(m):
                for j in range(k):
                    a, b = members[hot][i], members[o][j]
                    d = weight[a] - weight[b]
                    if o == hot or d <= 0:
                        continue
                    if forbid_dup and (expert[a] in expert[members[o]] or expert[b] in expert[members[hot]]):
                        continue
                    score = max(top - d, loads[o] + d)
                    if score < best_score:
                        best, best_score = (i, o, j), score
        if best is None or not best_score < top - 1e-9 * max(top, 1e-30):
            break
        i, o, j = best
        members[hot][i], members[o][j] = members[o][j], members[hot][i]
    out = np.empty_like(bin_of)
    for b in range(m):
        out[members[b]] = b
    return out


@pytest.mark.parametrize("seed", range(6))
def test_refine_swaps_matches_the_per_row_rule(seed):
    rng = np.random.default_rng(seed)
    bins, per_bin = int(rng.choice([2, 3, 4])), int(rng.integers(2, 4))
    item_expert, weight = _problem(rng, 3, bins, per_bin, ties=seed % 2 == 0)
    start = np.argsort(rng.random(item_expert.shape), 1) % bins
    target = weight.sum(1) / bins * 1.05 if seed % 3 == 0 else None
    for forbid_dup in (True, False):
        got = refine_swaps(weight, item_expert, start, bins, target=target, forbid_dup=forbid_dup)
        for x in range(3):
            want = _refine_row(weight[x], item_expert[x], start[x], bins,
                               None if target is None else target[x], forbid_dup)
            assert np.array_equal(got[x], want), (seed, forbid_dup, x)


def _greedy_row(weight, expert, m):
    n = weight.size
    k = n // m
    load, fill, held = np.zeros(m), np.zeros(m, dtype=int), [set() for _ in range(m)]
    out = np.empty(n, dtype=np.int64)
    for item in np.argsort(-weight, kind="stable"):
        room = [b for b in range(m) if fill[b] < k]
        free = [b for b in room if expert is None or expert[item] not in held[b]] or room
        b = min(free, key=lambda b: (load[b], b))
        out[item] = b
        load[b] += weight[item]
        fill[b] += 1
        if expert is not None:
            held[b].add(int(expert[item]))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_greedy_pack_matches_the_per_row_rule(seed):
    rng = np.random.default_rng(100 + seed)
    bins, per_bin = int(rng.choice([2, 4, 8])), int(rng.integers(1, 5))
    item_expert, weight = _problem(rng, 4, bins, per_bin, ties=seed % 2 == 0)
    for experts in (item_expert, None):
        got, rank = greedy_pack(weight, experts, bins)
        assert rank.shape == got.shape == weight.shape
        for x in range(4):
            assert np.array_equal(got[x], _greedy_row(weight[x], None if experts is None else experts[x], bins))


def _sticky_row(expert, weight, old, m):
    """Replica r of an expert goes to the GPU of its r-th distinct old GPU; the rest
    heaviest first to the lightest GPU with room not holding the expert."""
    k = old.size // m
    homes: dict[int, list[int]] = {}
    for slot, e in enumerate(old.tolist()):
        if e >= 0 and slot // k not in homes.setdefault(e, []):
            homes[e].append(slot // k)
    out = np.full(expert.size, -1)
    load, fill, held = np.zeros(m), np.zeros(m, dtype=int), set()
    rest = []
    for i, e in enumerate(expert.tolist()):
        if homes.get(e):
            g = homes[e].pop(0)
            out[i], fill[g] = g, fill[g] + 1
            load[g] += weight[i]
            held.add((g, e))
        else:
            rest.append(i)
    for i in sorted(rest, key=lambda i: -weight[i]):
        room = [g for g in range(m) if fill[g] < k]
        free = [g for g in room if (g, int(expert[i])) not in held] or room
        g = min(free, key=lambda g: (load[g], g))
        out[i], fill[g] = g, fill[g] + 1
        load[g] += weight[i]
        held.add((g, int(expert[i])))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_sticky_bins_matches_the_per_row_rule(seed):
    rng = np.random.default_rng(200 + seed)
    bins, per_bin = int(rng.choice([1, 2, 4, 8])), int(rng.integers(1, 5))
    item_expert, weight = _problem(rng, 4, bins, per_bin, ties=seed % 2 == 0)
    old = np.take_along_axis(item_expert, np.argsort(rng.random(item_expert.shape), 1), 1)
    if seed % 3 == 1:
        old = np.where(rng.random(old.shape) < 0.3, -1, old)  # experts from outside the domain
    if seed % 3 == 2:
        old = rng.integers(-1, item_expert.max() + 1, old.shape)
    got = sticky_bins(item_expert, weight, old, bins)
    assert got.shape == item_expert.shape
    for x in range(4):
        assert np.array_equal(got[x], _sticky_row(item_expert[x], weight[x], old[x], bins))


def test_compute_par_matches_a_per_step_loop():
    rng = np.random.default_rng(7)
    steps, layers, experts, gpus = 5, 3, 8, 4
    load = rng.integers(0, 50, (steps, layers, experts))
    load[:, 1] = 0  # an idle layer: PAR 1
    phy = np.concatenate([np.tile(np.arange(experts), (layers, 1)), rng.integers(0, experts, (layers, 4))], 1)
    got = compute_par(load, phy, gpus)
    assert got.shape == (steps, layers)
    for s in range(steps):
        for x in range(layers):
            copies = np.bincount(phy[x], minlength=experts)
            gpu = (load[s, x][phy[x]] / copies[phy[x]]).reshape(gpus, -1).sum(1)
            want = gpu.max() / gpu.mean() if gpu.mean() > 0 else 1.0
            assert got[s, x] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_replicate_matches_the_per_row_rule(seed):
    """Each redundant slot goes to the expert with the highest load per replica among
    those below the cap (the cap lifted once every expert is at it), first index on ties."""
    rng = np.random.default_rng(300 + seed)
    experts = int(rng.integers(2, 12))
    slots = experts + int(rng.integers(0, 3 * experts))
    weight = np.round(rng.lognormal(0.0, 1.0, (4, experts)) * 2) / 2
    cap = [None, 1, 2][seed % 3]
    counts, extra = replicate(weight, slots, cap)
    assert counts.shape == (4, experts) and extra.shape == (4, slots - experts)
    for x in range(4):
        c = np.ones(experts, dtype=np.int64)
        for t in range(slots - experts):
            per = weight[x] / c
            below = per if cap is None or (c >= cap).all() else np.where(c >= cap, -np.inf, per)
            pick = int(np.argmax(below))
            assert extra[x, t] == pick
            c[pick] += 1
        assert np.array_equal(counts[x], c)
