"""Where expert load piles up and how fast it moves: pure numpy over a ``Recording``.

Balancedness (ARCHITECTURE.md): per layer mean rank load / max rank load; over layers
sum(mean) / sum(max); 1.0 is perfect and an idle layer counts as 1.0. Rank loads are "under
the recorded placement": exact per-slot counts when the dump has them (ours with
``physical_count``, SGLang ``per_pass``), otherwise each expert's count split evenly over
its copies in ``phy2log``, otherwise the identity placement (expert e on rank e // (E / R)).

Shape legend: S steps, L layers, E logical experts, P slots, R ranks, W windows.
"""

from __future__ import annotations

import math

import numpy as np

from launch.profile.readers import Dump, DumpError, Recording

SGLANG_WINDOWS = (10, 100, 1000)
NUM_HOT = 5


def identity_phy2log(num_layers: int, num_experts: int) -> np.ndarray:
    """[L, E] int64: slot p holds expert p (no redundancy), the placement without EPLB."""
    return np.tile(np.arange(num_experts, dtype=np.int64), (num_layers, 1))


def check_ep_sizes(ep_sizes: list[int], num_experts: int) -> None:
    """DumpError naming the first EP size that is not positive or does not divide E."""
    for ep in ep_sizes:
        if ep <= 0 or num_experts % ep:
            raise DumpError(f"EP size {ep} does not divide the {num_experts} experts of this recording")


def recorded_num_ranks(recording: Recording, fallback: int | None) -> int:
    """EP size of the recorded placement: what the dumps say (they must agree; one rank says
    nothing), else ``fallback`` (``--recorded-ep``, or the first ``--ep``), else 1."""
    # A one-rank run says nothing about how its experts would spread: analyse it at the fallback.
    said = {d.num_ranks for d in recording.dumps if d.num_ranks is not None and d.num_ranks > 1}
    said |= {len(d.ranks) for d in recording.dumps if d.format == "sglang-per_pass" and len(d.ranks) > 1}
    if len(said) > 1:
        raise DumpError(f"the dumps were recorded at different EP sizes {sorted(said)}; profile them separately")
    if said:
        return said.pop()
    return int(fallback) if fallback else 1


def slot_rank_load(slot_load: np.ndarray, num_ranks: int, path: str = "placement") -> np.ndarray:
    """slot_load: [..., P] -> [..., R] (rank r holds slots r*P/R .. (r+1)*P/R - 1)."""
    num_slots = slot_load.shape[-1]
    if num_ranks <= 0 or num_slots % num_ranks:
        raise DumpError(f"{path}: {num_slots} slots cannot be split evenly over EP size {num_ranks}")
    return slot_load.reshape(*slot_load.shape[:-1], num_ranks, num_slots // num_ranks).sum(-1)


def even_slot_load(load: np.ndarray, phy2log: np.ndarray) -> np.ndarray:
    """load: [..., L, E] per expert; phy2log: [L, P] -> [..., L, P], each expert's load split
    evenly over its copies."""
    num_layers, num_experts = load.shape[-2:]
    copies = np.zeros((num_layers, num_experts), dtype=np.float64)
    np.add.at(copies, (np.arange(num_layers)[:, None], phy2log), 1.0)
    share = load / np.maximum(copies, 1.0)
    index = np.broadcast_to(phy2log, (*load.shape[:-2], *phy2log.shape))
    return np.take_along_axis(share, index, -1)


def dump_rank_load(dump: Dump, num_ranks: int) -> np.ndarray:
    """[S, L, R] float64 rank loads of one dump under its recorded placement (the identity
    placement for a dump recorded on one rank)."""
    if dump.num_ranks == 1:
        return slot_rank_load(even_slot_load(dump.logical_count, identity_phy2log(*dump.logical_count.shape[1:])),
                              num_ranks, dump.path)
    if dump.physical_count is not None:
        return slot_rank_load(dump.physical_count, num_ranks, dump.path)
    phy = dump.phy2log if dump.phy2log is not None else identity_phy2log(*dump.logical_count.shape[1:])
    if phy.shape[1] % num_ranks:
        what = "slots" if dump.phy2log is not None else "experts"
        raise DumpError(f"EP size {num_ranks} does not divide the {phy.shape[1]} {what} of {dump.path}")
    return slot_rank_load(even_slot_load(dump.logical_count, phy), num_ranks, dump.path)


def recording_rank_load(recording: Recording, num_ranks: int) -> np.ndarray:
    """[S, L, R] rank loads of the whole recording, each dump under its own placement."""
    return np.concatenate([dump_rank_load(d, num_ranks) for d in recording.dumps])


def layer_balancedness(rank_load: np.ndarray) -> tuple[np.ndarray, float]:
    """rank_load: [L, R] -> (per layer [L], overall sum(mean) / sum(max)); idle layers 1.0."""
    mean, peak = rank_load.mean(-1), rank_load.max(-1)
    per_layer = np.where(peak > 0, mean / np.where(peak > 0, peak, 1.0), 1.0)
    overall = float(mean.sum() / peak.sum()) if peak.sum() > 0 else 1.0
    return per_layer, overall


def step_balancedness(rank_load: np.ndarray) -> np.ndarray:
    """rank_load: [S, L, R] -> [S]: each step's sum over layers of mean / sum of max (1.0 idle)."""
    mean, peak = rank_load.mean(-1).sum(-1), rank_load.max(-1).sum(-1)
    return np.where(peak > 0, mean / np.where(peak > 0, peak, 1.0), 1.0)


def trailing_mean(values: np.ndarray, window: int) -> np.ndarray:
    """[S] -> [S]: mean of the last ``window`` values at each step (fewer at the start), as
    SGLang's ``last_{10,100,1000}_average_balancedness``."""
    csum = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])
    idx = np.arange(1, values.size + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def hot_experts(load: np.ndarray, num: int = NUM_HOT) -> tuple[np.ndarray, np.ndarray]:
    """load: [L, E] -> (ids [L, n] most loaded first, ties by lower id; share [L, n] of the
    layer's load, 0 for idle layers), n = min(num, E)."""
    num = min(num, load.shape[1])
    order = np.argsort(-load, axis=1, kind="stable")[:, :num]
    total = load.sum(1, keepdims=True)
    share = np.take_along_axis(load, order, 1) / np.where(total > 0, total, 1.0)
    return order, share


def default_top(num_experts: int) -> int:
    """Size of the hot set churn compares: E / 8 rounded, at least 2 (1 for E < 4)."""
    return 1 if num_experts < 4 else max(2, round(num_experts / 8))


def window_loads(count: np.ndarray, window: int) -> np.ndarray:
    """count: [S, ...] -> [S // window, ...] sums over consecutive full windows."""
    num = count.shape[0] // window
    return count[: num * window].reshape(num, window, *count.shape[1:]).sum(1)


def hot_set_churn(count: np.ndarray, window: int, top: int) -> np.ndarray:
    """count: [S, L, E] -> overlap [W - 1, L]: the fraction of window w's ``top`` experts that
    were also in window w-1's top (1.0 = the hot set stayed; top / E is chance). NaN where a
    layer was idle in either window."""
    loads = window_loads(count, window)
    if loads.shape[0] < 2:
        return np.zeros((0, count.shape[1]))
    order = np.argsort(-loads, axis=2, kind="stable")[:, :, :top]
    member = np.zeros(loads.shape, dtype=bool)
    np.put_along_axis(member, order, True, 2)
    overlap = (member[1:] & member[:-1]).sum(2) / float(top)
    idle = loads.sum(2) == 0
    return np.where(idle[1:] | idle[:-1], np.nan, overlap)


def churn_windows(num_steps: int) -> list[int]:
    """SGLang's windows that give at least 3 full windows (else one window of S // 4 steps)."""
    fits = [w for w in SGLANG_WINDOWS if num_steps // w >= 3]
    return fits or ([max(1, num_steps // 4)] if num_steps >= 2 else [])


def drift_layer(count: np.ndarray, window: int, top: int) -> int:
    """The layer whose hot set changes most (lowest mean overlap); 0 when nothing to compare."""
    per_layer = mean_over(hot_set_churn(count, window, top), axis=0)
    if per_layer.size == 0 or np.isnan(per_layer).all():
        return 0
    return int(np.nanargmin(per_layer))


def mean_over(x: np.ndarray, axis: int) -> np.ndarray:
    """Mean ignoring NaN along axis; NaN (no warning) where every value is NaN."""
    valid = ~np.isnan(x)
    num = valid.sum(axis)
    total = np.where(valid, x, 0.0).sum(axis)
    return np.where(num > 0, total / np.maximum(num, 1), np.nan)


def drops_per_layer(dropped: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """dropped: [S, L] assignments dropped by capacity; count: [S, L, E] assignments routed.
    Returns (dropped per layer [L], dropped / routed per layer [L])."""
    total = dropped.sum(0)
    routed = count.sum((0, 2))
    return total, np.where(routed > 0, total / np.where(routed > 0, routed, 1.0), 0.0)


def windows_to_show(num_steps: int) -> list[int]:
    """SGLang windows no longer than the recording (10 always)."""
    return [w for w in SGLANG_WINDOWS if w == SGLANG_WINDOWS[0] or w <= num_steps]


def finite(x: float) -> float | None:
    """JSON-safe float: None for NaN or infinity."""
    return float(x) if math.isfinite(x) else None
