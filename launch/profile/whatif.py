"""What redundant experts, a bigger EP group or an EPLB schedule would buy, from the balancer.

``compute_what_if``: for each EP size x redundant experts x policy (global; hierarchical over
``num_nodes`` nodes and ``num_groups`` expert groups), the placement ``balancer.rebalance_experts``
makes from the whole recording's load and its predicted balancedness (each expert's load split
evenly over its copies), the gain over no EPLB (the identity placement, no redundancy) and a
held-out figure (placed from the first half, scored on the second).

``simulate_eplb``: replay the recording with a rebalance every ``interval`` steps from the last
``window`` steps; the realized balancedness is sum over steps and layers of mean rank load /
sum of max rank load (what a step's time follows). ``recommend_redundant`` and
``recommend_eplb_config`` pick ``--num-redundant-experts`` and ``--eplb-config`` from those
figures; the latter says EPLB does not pay when no schedule beats the placement without it.

Redundant counts are bounded (``redundant_problem``): at most ``MAX_COPIES_PER_EXPERT - 1``
times E, so a layer has at most ``MAX_COPIES_PER_EXPERT`` x E slots. Every array of the grid
and the replay that has a slot axis ([L, P], [interval, L, P]) and the balancer's work grow
with P (the balancer's faster than linearly), and EPLB deployments run a few redundant
experts per rank (DeepSeek-V3: 32 for 256 experts on 32 ranks), far below the bound.

Shape legend: S steps, L layers, E experts, P slots, R ranks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from tqdm import tqdm

from balancer import rebalance_experts
from launch.profile.analysis import (
    SGLANG_WINDOWS,
    even_slot_load,
    identity_phy2log,
    layer_balancedness,
    slot_rank_load,
)

INTERVALS = (10, 30, 100, 300, 1000, 3000)
MAX_REBALANCES = 64
GAIN_SHARE = 0.9
MIN_GAIN = 0.01
INTERVAL_TOLERANCE = 0.01
MAX_COPIES_PER_EXPERT = 4


@dataclass(frozen=True)
class WhatIfRow:
    """One EP size x redundant x policy; balancedness predicted on the whole recording."""

    ep: int
    redundant: int
    policy: str
    balancedness: float
    no_eplb_balancedness: float
    gain_over_no_eplb: float
    held_out_balancedness: float | None
    num_nodes: int
    num_groups: int


def default_ep_sizes(num_experts: int) -> list[int]:
    """Powers of two from 2 to 64 that divide E (E itself when none does)."""
    return [ep for ep in (2, 4, 8, 16, 32, 64) if ep <= num_experts and num_experts % ep == 0] or [num_experts]


def max_redundant(num_experts: int) -> int:
    """The largest redundant count the what-if places for E experts: (MAX_COPIES_PER_EXPERT - 1) x E."""
    return (MAX_COPIES_PER_EXPERT - 1) * num_experts


def redundant_problem(redundant: list[int] | None, num_experts: int, flag: str = "--redundant") -> str | None:
    """One line naming ``flag`` and the first count above ``max_redundant(E)`` (or below 0),
    before anything is allocated for it; None when every count is in range or none was given."""
    limit = max_redundant(num_experts)
    for r in redundant or []:
        if not 0 <= r <= limit:
            return (f"{flag} {r}: at most {limit} redundant experts per layer for {num_experts} experts "
                    f"({MAX_COPIES_PER_EXPERT - 1} x E, so {MAX_COPIES_PER_EXPERT} slots per expert on average; "
                    "EPLB deployments use a few per EP rank)")
    return None


def redundant_options(ep: int, num_experts: int, given: list[int] | None) -> list[int]:
    """Redundant-expert counts for an EP size: the given ones whose E + r slots split evenly
    over ep ranks, else 0 and 1, 2, 4 extra slots per rank (at most E extra)."""
    if given:
        return sorted({r for r in given if r >= 0 and (num_experts + r) % ep == 0})
    return sorted({r for r in (0, ep, 2 * ep, 4 * ep) if r <= num_experts})


def predicted(load: np.ndarray, phy2log: np.ndarray, num_ranks: int) -> float:
    """Overall balancedness of load [L, E] under phy2log [L, P] on num_ranks ranks."""
    return layer_balancedness(slot_rank_load(even_slot_load(load, phy2log), num_ranks))[1]


def _place(load: np.ndarray, num_slots: int, ep: int, policy: str, groups: int, nodes: int) -> np.ndarray:
    if load.sum() <= 0:
        return np.tile(np.arange(num_slots) % load.shape[1], (load.shape[0], 1))
    if policy == "global":
        groups = nodes = 1
    phy, _, _ = rebalance_experts(load, num_slots, groups, nodes, ep, policy=policy)
    return phy.numpy()


def compute_what_if(count: np.ndarray, ep_sizes: list[int], redundant: list[int] | None, *, num_groups: int,
                    num_nodes: int, progress: bool = True) -> tuple[list[WhatIfRow], list[str]]:
    """count: [S, L, E] -> (rows, skipped combinations with the reason). ValueError for a
    redundant count out of range (``redundant_problem``)."""
    steps, num_layers, num_experts = count.shape
    if (problem := redundant_problem(redundant, num_experts, "redundant")) is not None:
        raise ValueError(problem)
    load = count.sum(0)
    half = steps // 2
    first, second = (count[:half].sum(0), count[half:].sum(0)) if half else (None, None)
    jobs, skipped = [], []
    for ep in ep_sizes:
        options = redundant_options(ep, num_experts, redundant)
        if redundant:
            bad = sorted(set(redundant) - set(options))
            if bad:
                skipped.append(f"EP {ep}: redundant {bad} do not give a slot count divisible by {ep}")
        for r in options:
            jobs.append((ep, r, "global"))
            reason = _hierarchical_problem(ep, num_experts, num_groups, num_nodes)
            if reason is None:
                jobs.append((ep, r, "hierarchical"))
            elif r == options[0]:
                skipped.append(f"EP {ep} hierarchical: {reason}")
    rows = []
    identity = identity_phy2log(num_layers, num_experts)
    for ep, r, policy in tqdm(jobs, desc="what-if placements", unit="placement", disable=not progress):
        base = predicted(load, identity, ep)
        phy = _place(load, num_experts + r, ep, policy, num_groups, num_nodes)
        bal = predicted(load, phy, ep)
        held = None
        if first is not None:
            held = predicted(second, _place(first, num_experts + r, ep, policy, num_groups, num_nodes), ep)
        rows.append(WhatIfRow(ep, r, policy, bal, base, bal / base if base > 0 else 1.0, held,
                              num_nodes if policy == "hierarchical" else 1,
                              num_groups if policy == "hierarchical" else 1))
    return rows, skipped


def _hierarchical_problem(ep: int, num_experts: int, num_groups: int, num_nodes: int) -> str | None:
    if num_nodes <= 1:
        return "needs more than one node (--hierarchical-nodes)"
    if ep % num_nodes:
        return f"{ep} ranks do not split over {num_nodes} nodes"
    if num_experts % num_groups:
        return f"{num_experts} experts do not form {num_groups} groups"
    if num_groups % num_nodes:
        return f"{num_groups} expert groups do not split over {num_nodes} nodes"
    return None


def rows_as_dicts(rows: list[WhatIfRow]) -> list[dict]:
    return [asdict(r) for r in rows]


# ---- EPLB schedule ----------------------------------------------------------------------


def simulate_eplb(count: np.ndarray, num_ranks: int, num_slots: int, window: int, interval: int, start: int,
                  max_rebalances: int = MAX_REBALANCES) -> float:
    """count: [S, L, E]. Rebalance at start, start + interval, ... (at most ``max_rebalances``
    evenly spaced of them are replayed) from the ``window`` steps before; each placement
    serves the ``interval`` steps after it. Returns sum(mean) / sum(max) of rank loads over
    the replayed steps and layers."""
    points = list(range(start, count.shape[0], interval))
    if len(points) > max_rebalances:
        points = [points[i] for i in np.linspace(0, len(points) - 1, max_rebalances).round().astype(int)]
    mean_sum = max_sum = 0.0
    for t in points:
        phy = _place(count[max(0, t - window):t].sum(0), num_slots, num_ranks, "global", 1, 1)
        ranks = slot_rank_load(even_slot_load(count[t:t + interval], phy), num_ranks)
        mean_sum += float(ranks.mean(-1).sum())
        max_sum += float(ranks.max(-1).sum())
    return mean_sum / max_sum if max_sum > 0 else 1.0


def static_realized(count: np.ndarray, phy2log: np.ndarray, num_ranks: int) -> float:
    """sum(mean) / sum(max) of rank loads over every step and layer of count [S, L, E]."""
    ranks = slot_rank_load(even_slot_load(count, phy2log), num_ranks)
    peak = float(ranks.max(-1).sum())
    return float(ranks.mean(-1).sum()) / peak if peak > 0 else 1.0


def recommend_redundant(rows: list[WhatIfRow], ep: int) -> dict | None:
    """Smallest redundant count at ``ep`` reaching 90 % of the best gain in predicted balancedness over
    no EPLB (best policy per count; the fewest when no count gains 0.01 over the fewest); None without
    rows for ep. The gain is counted from no EPLB, as the report's table shows it: measured from the
    fewest count instead, 0.988 -> 1.000 (against 0.756 without EPLB) recommended doubling the experts."""
    best: dict[int, WhatIfRow] = {}
    for row in rows:
        if row.ep == ep and (row.redundant not in best or row.balancedness > best[row.redundant].balancedness):
            best[row.redundant] = row
    if not best:
        return None
    counts = sorted(best)
    low = best[counts[0]].balancedness
    top = max(best.values(), key=lambda r: r.balancedness)
    if top.balancedness - low < MIN_GAIN:
        pick = best[counts[0]]
    else:
        base = min(best[counts[0]].no_eplb_balancedness, low)
        pick = next(best[r] for r in counts if best[r].balancedness - base >= GAIN_SHARE * (top.balancedness - base))
    held = "" if pick.held_out_balancedness is None else f" (held out {pick.held_out_balancedness:.3f})"
    basis = (f"EP {ep}: predicted balancedness {pick.balancedness:.3f}{held} with {pick.redundant} redundant "
             f"({pick.policy}), {low:.3f} with {counts[0]}, best {top.balancedness:.3f} with {top.redundant}; "
             f"no EPLB {pick.no_eplb_balancedness:.3f}")
    return {"value": pick.redundant, "ep": ep, "policy": pick.policy, "balancedness": pick.balancedness,
            "basis": basis}


def recommend_eplb_config(count: np.ndarray, num_ranks: int, redundant: int, churn: dict[int, float],
                          progress: bool = True) -> dict:
    """Replay the recording for windows 10/100/1000 x intervals 10..3000 that fit; pick the
    longest interval within 0.01 of the best realized balancedness (fewer weight moves),
    then its best window; the pick must beat no EPLB by ``MIN_GAIN``. Returns {"window_size",
    "step_interval", "balancedness", "no_eplb_balancedness", "replayed_from_step", "pays",
    "basis", "candidates"}; window_size
    and step_interval are None, with "basis" saying why, when the recording is too short to
    replay or when no schedule beats no EPLB by ``MIN_GAIN`` (``pays`` False: rebalancing
    does not pay on this load, the basis names the best schedule and both figures)."""
    steps, num_layers, num_experts = count.shape
    windows = [w for w in SGLANG_WINDOWS if 2 * w <= steps]
    if not windows:
        return {"window_size": None, "step_interval": None, "pays": None, "candidates": [],
                "basis": f"recording of {steps} steps is too short to replay an EPLB schedule (needs >= 20)"}
    start = max(windows)
    intervals = [i for i in INTERVALS if i <= steps - start]
    jobs = [(w, i) for w in windows for i in intervals]
    num_slots = num_experts + redundant
    candidates = []
    for w, i in tqdm(jobs, desc="replaying EPLB schedules", unit="schedule", disable=not progress):
        candidates.append({"window_size": w, "step_interval": i,
                           "balancedness": simulate_eplb(count, num_ranks, num_slots, w, i, start)})
    tail = count[start:]
    no_eplb = static_realized(tail, identity_phy2log(num_layers, num_experts), num_ranks)
    top = max(candidates, key=lambda c: c["balancedness"])
    drift = ", ".join(f"{w}-step windows {o:.2f}" for w, o in sorted(churn.items()))
    where = f"replayed steps {start}-{steps} at EP {num_ranks} with {redundant} redundant: "
    trail = f"; hot-set overlap between consecutive {drift}" if drift else ""
    common = {"no_eplb_balancedness": no_eplb, "replayed_from_step": start, "candidates": candidates}
    if top["balancedness"] < no_eplb + MIN_GAIN:
        basis = (f"{where}rebalancing does not pay on this load: no schedule beats no EPLB by {MIN_GAIN} "
                 f"(best: window {top['window_size']}, interval {top['step_interval']} realizes "
                 f"{top['balancedness']:.3f}; no EPLB {no_eplb:.3f}); leave EPLB off" + trail)
        return {"window_size": None, "step_interval": None, "balancedness": top["balancedness"], "pays": False,
                "basis": basis, **common}
    # The pick must itself pay: within the tolerance of the best, and MIN_GAIN over no EPLB.
    floor = max(top["balancedness"] - INTERVAL_TOLERANCE, no_eplb + MIN_GAIN)
    pick = max((c for c in candidates if c["balancedness"] >= floor),
               key=lambda c: (c["step_interval"], c["balancedness"]))
    basis = (f"{where}window {pick['window_size']}, interval {pick['step_interval']} realizes balancedness "
             f"{pick['balancedness']:.3f} (best {top['balancedness']:.3f} at window {top['window_size']}, "
             f"interval {top['step_interval']}; no EPLB {no_eplb:.3f})" + trail)
    return {"window_size": pick["window_size"], "step_interval": pick["step_interval"],
            "balancedness": pick["balancedness"], "pays": True, "basis": basis, **common}
