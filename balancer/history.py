"""rebalance_from_history: forecast the coming load, place for it, move only when it pays.

Called often (every ~100 steps) with the per-step load window; the decision when to
move is its own. Per call:

  Step 0 (early_stay only): per layer, the placement in force on the last `interval`
          steps against the steps before them; layers that did not get worse stay
          here, the others go through Steps 1-4;
  Step 1: forecast the next `interval` steps (balancer/forecast.py): mean load per
          expert (adaptive half-life, trend, bursts) and each expert's step noise;
  Step 2: candidates from the current placement, built by `rebalance_experts`'
          machinery on mean + volatility_weight x std (a volatile hot expert weighs
          more than a steady one of the same mean, so it is the one given a replica):
          the sticky/fresh placement `rebalance_experts(..., old_phy2log=old)` gives,
          and a lighter one that starts from `old` and swaps only until every GPU is
          halfway from the old peak to that placement's peak (fewer moved slots);
  Step 3: score each candidate per layer on sampled steps (the forecast plus recent
          step noise): the mean peak-to-average ratio (PAR), as the competition does;
  Step 4: per layer keep the old slots unless a candidate's modeled time gain,
          step_cost x horizon / L x (PAR_old - PAR_new), beats margin x its cost,
          slot_cost x slots whose expert changed. The horizon is the time the
          forecast is expected to hold: `horizon_half_lives` x the chosen half-life,
          within [interval, max_horizon].

Modeled time (huawei-cpl-zurich/moe-competition-docs): 60 x mean PAR over the trace +
moved slots x 88,080,384 B / 9e11 B/s; per step that is step_cost = 60 / trace steps
seconds per unit of PAR. Shape legend: W steps, L layers, E logical experts, P slots.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch

from balancer.balancedness import as_numpy, compute_par, slot_load_of_experts
from balancer.forecast import Forecast, forecast_load
from balancer.placement import compute_log2phy
from balancer.policy import POLICIES, _place, _validate, rebalance_experts

SLOT_BYTES = 88_080_384  # one DeepSeek-R1 expert (fp8), the competition's transfer unit
# Step 4's paired test on the last steps needs this many of them: one step has no spread, so any
# candidate fitted to it would "win"; with one, nothing moves.
MIN_PAIRED_STEPS = 2
LINK_BYTES_PER_S = 9e11


@dataclass(frozen=True)
class HistoryOptions:
    """interval: steps until the next call (the forecast horizon); step_cost: modeled
    seconds per step per unit of PAR (competition: 60 / trace steps); slot_cost: seconds
    to move one slot; margin: a move must gain margin x its cost; horizon_half_lives,
    max_horizon: how long a gain is counted (in chosen half-lives, capped);
    volatility_weight: std added to the mean when placing; burst_sigmas, burst_steps:
    see forecast_load;
    policy: rebalance_experts' policy for the candidates;
    early_stay: first check, per layer, whether the placement in force still handles the
    last `interval` steps as well as the steps before them (its PAR has not risen by more
    than stay_sigmas standard errors); those layers stay without forecasting or building
    candidates, the others get a full evaluation (the decision is per layer, so their
    answer is a full call's). A caller that sets it between full evaluations (the driver:
    every check_interval steps, full every full_check_interval) answers a burst within one
    short interval at little CPU; it must still run full evaluations (early_stay=False)
    regularly, since a slow drift never looks like a jump."""

    interval: int = 64
    step_cost: float = 60.0 / 8192
    slot_cost: float = SLOT_BYTES / LINK_BYTES_PER_S
    margin: float = 1.5
    horizon_half_lives: float = 2.0
    max_horizon: int = 4096
    volatility_weight: float = 1.0
    burst_sigmas: float = 4.0
    burst_steps: int = 16
    policy: str = "auto"
    early_stay: bool = False
    stay_sigmas: float = 3.0

    def __post_init__(self) -> None:
        if self.interval <= 0 or self.max_horizon <= 0 or self.burst_steps <= 0:
            raise ValueError(f"interval={self.interval}, max_horizon={self.max_horizon} and "
                             f"burst_steps={self.burst_steps} must be positive")
        for name in ("step_cost", "slot_cost", "margin", "horizon_half_lives", "volatility_weight", "burst_sigmas",
                     "stay_sigmas"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value} must be finite and >= 0")
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r} is not one of {POLICIES}")

    @classmethod
    def from_kwargs(cls, options: dict) -> HistoryOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)


@dataclass(frozen=True)
class HistoryDecision:
    """phy2log [L, P] int64 (old_phy2log where staying); moved [L] slots changed per layer;
    par_old, par_new [L] predicted mean PAR over sampled steps (layers the early check kept:
    the old placement's mean PAR on the last interval steps, both); gain, cost: modeled
    seconds won and spent; forecast: what the decision was based on, for the evaluated
    layers (None: the early check kept every layer); evaluated: [L] bool, the layers that
    got a full evaluation (None: all)."""

    phy2log: np.ndarray
    moved: np.ndarray
    par_old: np.ndarray
    par_new: np.ndarray
    gain: float
    cost: float
    forecast: Forecast | None
    evaluated: np.ndarray | None = None  # None: every layer

    @property
    def num_moved(self) -> int:
        return int(self.moved.sum())

    @property
    def reason(self) -> str:
        if self.forecast is None:
            return "stay: the last steps are balanced as well as the steps before them"
        if self.num_moved == 0 and self.evaluated is not None and not self.evaluated.all():
            return f"stay: no move pays for itself on the {int(self.evaluated.sum())} layers that got worse"
        if self.num_moved == 0:
            return "stay: no move pays for itself"
        layers = int((self.moved > 0).sum())
        return (f"move {self.num_moved} slots on {layers} layers: predicted PAR "
                f"{self.par_old.mean():.4f} -> {self.par_new.mean():.4f}, gain {self.gain:.4f}s > cost {self.cost:.4f}s")


def plan_from_history(history: torch.Tensor | np.ndarray, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int, *, old_phy2log: torch.Tensor | np.ndarray | None,
                      options: HistoryOptions | None = None, **option_fields: Any) -> HistoryDecision:
    """The decision behind rebalance_from_history (same arguments), with its reasons.

    Options come as HistoryOptions fields (interval=16, early_stay=True, ...) or as one
    options=HistoryOptions(...), not both."""
    opt = _resolve_options(options, option_fields)
    hist = as_numpy(history, "history", 3)
    if hist.shape[0] == 0 or 0 in hist.shape:
        raise ValueError(f"history must be a non-empty [W, L, E], got shape {hist.shape}")
    if hist.dtype.kind not in "iuf" or hist.dtype.kind == "f" and not np.isfinite(hist).all() or hist.min() < 0:
        raise ValueError("history must hold finite, non-negative real loads")
    num_layers, num_experts = hist.shape[1:]
    _validate(hist[0], num_replicas, num_groups, num_nodes, num_gpus, opt.policy)
    args = (num_replicas, num_groups, num_nodes, num_gpus)
    old = None
    if old_phy2log is not None:
        old = as_numpy(old_phy2log, "old_phy2log", 2).astype(np.int64)
        if old.shape != (num_layers, num_replicas) or old.min() < 0 or old.max() >= num_experts:
            raise ValueError(f"old_phy2log must be [{num_layers}, {num_replicas}] with ids in [0, {num_experts}), "
                             f"got shape {old.shape}")
        if opt.early_stay:
            checked = _early_check(hist, old, num_gpus, opt)
            if checked is not None:
                return _escalate(hist, args, old, opt, *checked)
    # Step 1.
    fc = forecast_load(hist, opt.interval, burst_sigmas=opt.burst_sigmas, burst_steps=opt.burst_steps)
    weight = fc.mean + opt.volatility_weight * fc.std
    if old is None:
        phy = rebalance_experts(weight, *args, policy=opt.policy)[0].numpy()
        zeros = np.zeros(num_layers)
        return HistoryDecision(phy, np.full(num_layers, num_replicas), zeros, zeros, 0.0, 0.0, fc)
    horizon = np.clip(opt.horizon_half_lives * fc.half_life, opt.interval, opt.max_horizon)
    value = opt.step_cost * horizon / num_layers  # [L] seconds per unit of PAR on a layer
    # Step 2, on the layers where even a perfect split of the forecast could pay for a swap.
    peak_share = _peak(fc.mean, old, num_gpus) / np.maximum(fc.mean.sum(1) / num_gpus, 1e-12)
    rows = np.nonzero(value * (peak_share - 1.0) > opt.margin * opt.slot_cost * 2)[0]
    cands = []
    if rows.size:
        first = old.copy()
        first[rows] = rebalance_experts(weight[rows], *args, old_phy2log=old[rows], policy=opt.policy)[0].numpy()
        cands.append(first)
        if opt.policy != "deepseek":
            second = old.copy()
            second[rows] = _lighter(weight[rows], args, old[rows], first[rows], opt.policy)
            cands.append(second)
    return _choose(hist, fc, old, cands, value, opt, num_gpus)


def _resolve_options(options: HistoryOptions | None, option_fields: dict) -> HistoryOptions:
    """options= or HistoryOptions keyword fields (unknown ones raise naming them) -> HistoryOptions."""
    if options is None:
        return HistoryOptions.from_kwargs(option_fields)
    if not isinstance(options, HistoryOptions):
        raise ValueError(f"options must be a HistoryOptions, got {type(options).__name__}")
    if option_fields:
        raise ValueError(f"pass options=HistoryOptions(...) or option keywords {sorted(option_fields)}, not both")
    return options


def _choose(hist, fc: Forecast, old: np.ndarray, cands: list[np.ndarray], value: np.ndarray,
            opt: HistoryOptions, num_gpus: int) -> HistoryDecision:
    """Steps 3-4: per layer the candidate with the largest net modeled gain, or old."""
    num_layers = old.shape[0]
    # Step 3.
    scenarios = np.maximum(fc.mean[None] + fc.residuals, 0.0)
    recent = hist[-len(fc.residuals):]  # the last steps as they were: a check independent of the forecast
    par_old = compute_par(scenarios, old, num_gpus).mean(0)
    recent_old = compute_par(recent, old, num_gpus)  # [S, L]
    best, best_net = old.copy(), np.zeros(num_layers)
    par_new, moved = par_old.copy(), np.zeros(num_layers, dtype=np.int64)
    gain, cost = np.zeros(num_layers), np.zeros(num_layers)
    for cand in cands:
        n = (cand != old).sum(1)
        changed = np.nonzero(n)[0]  # PAR is per layer: unchanged layers keep par_old exactly
        if changed.size == 0:
            continue
        par = par_old.copy()
        par[changed] = compute_par(scenarios[:, changed], cand[changed], num_gpus).mean(0)
        g, c = value * (par_old - par), opt.slot_cost * n
        # Step 4. A candidate fitted to the forecast's own noise must also win on the last
        # steps as they were, by more than 2 standard errors (paired), or it is no gain.
        diff = np.zeros_like(recent_old)
        diff[:, changed] = recent_old[:, changed] - compute_par(recent[:, changed], cand[changed], num_gpus)
        noise = 2.0 * diff.std(0) / np.sqrt(max(len(diff) - 1, 1))
        paired = len(diff) >= MIN_PAIRED_STEPS  # else too few steps to tell a gain from noise
        net = np.where(paired & (diff.mean(0) > noise), g - opt.margin * c, 0.0)
        take = net > best_net
        best[take], best_net[take], par_new[take], moved[take] = cand[take], net[take], par[take], n[take]
        gain[take], cost[take] = g[take], c[take]
    return HistoryDecision(best, moved, par_old, par_new, float(gain.sum()), float(cost.sum()), fc)


def _early_check(hist: np.ndarray, old: np.ndarray, num_gpus: int,
                 opt: HistoryOptions) -> tuple[np.ndarray, np.ndarray] | None:
    """The early check: old's per-step PAR on the last `interval` steps against the (up to
    4 x interval, >= 64) steps before them, per layer. Returns (worse [L] bool: got worse by
    more than stay_sigmas standard errors, recent mean PAR [L]), or None when the window is
    too short to tell (then every layer gets a full evaluation)."""
    num_steps = hist.shape[0]
    recent = min(opt.interval, num_steps // 2)
    before = min(num_steps - recent, max(64, 4 * opt.interval))
    if recent < 2 or before < 2:
        return None
    par = compute_par(hist[num_steps - recent - before:], old, num_gpus)  # [before + recent, L]
    now, then = par[before:], par[:before]
    se = np.sqrt(now.var(0, ddof=1) / recent + then.var(0, ddof=1) / before)
    return now.mean(0) - then.mean(0) > opt.stay_sigmas * se + 1e-12, now.mean(0)


def _escalate(hist, args, old, opt, worse, par_recent) -> HistoryDecision:
    """Layers the early check kept stay; the others are planned by a full evaluation of
    just those layers (step_cost scaled so each layer's value matches an all-layer call)."""
    num_layers = old.shape[0]
    layers = np.nonzero(worse)[0]
    if layers.size == 0:
        return HistoryDecision(old.copy(), np.zeros(num_layers, dtype=np.int64), par_recent, par_recent.copy(),
                               0.0, 0.0, None, worse)
    if layers.size == num_layers:
        full = plan_from_history(hist, *args, old_phy2log=old, options=replace(opt, early_stay=False))
        return replace(full, evaluated=worse)
    sub = plan_from_history(hist[:, layers], *args, old_phy2log=old[layers],
                            options=replace(opt, early_stay=False, step_cost=opt.step_cost * layers.size / num_layers))
    phy2log, moved = old.copy(), np.zeros(num_layers, dtype=np.int64)
    par_old, par_new = par_recent.copy(), par_recent.copy()
    phy2log[layers], moved[layers], par_old[layers], par_new[layers] = sub.phy2log, sub.moved, sub.par_old, sub.par_new
    return HistoryDecision(phy2log, moved, par_old, par_new, sub.gain, sub.cost, sub.forecast, worse)


def _lighter(weight, args, old, target_phy, policy) -> np.ndarray:
    """Sticky placement from old that swaps only until each GPU load is halfway between
    old's peak and target_phy's peak (on weight) -> phy2log [L, P]."""
    num_replicas, num_groups, num_nodes, num_gpus = args
    hierarchical = num_groups % num_nodes == 0 if policy == "auto" else policy == "hierarchical"
    groups, nodes = (num_groups, num_nodes) if hierarchical else (1, 1)
    peak_old = _peak(weight, old, num_gpus)
    peak_new = _peak(weight, target_phy, num_gpus)
    max_load = np.maximum((peak_old + peak_new) / 2, weight.sum(1) / num_gpus) * (1 + 1e-9)
    return _place(weight, num_replicas, groups, nodes, num_gpus, old, max_load, allow_dup=False)


def _peak(weight: np.ndarray, phy: np.ndarray, num_gpus: int) -> np.ndarray:
    slot = slot_load_of_experts(weight, phy)
    return slot.reshape(slot.shape[0], num_gpus, -1).sum(-1).max(1)


def full_horizon(check_interval: int, full_interval: int) -> int:
    """Steps from a scheduled full evaluation to the next one (checks every check_interval,
    a full one at least every full_interval): the largest multiple of check_interval within
    full_interval, at least check_interval."""
    return max(check_interval, full_interval // check_interval * check_interval)


def rebalance_from_history(history: torch.Tensor | np.ndarray, num_replicas: int, num_groups: int,
                           num_nodes: int, num_gpus: int, *,
                           old_phy2log: torch.Tensor | np.ndarray | None,
                           options: HistoryOptions | None = None,
                           **option_fields: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Place experts for the load to come, or keep old_phy2log when no move pays.

    history: [W, L, E] per-step logical expert loads, oldest first (torch or numpy, any
    real dtype, >= 0, W >= 1). num_replicas, num_groups, num_nodes, num_gpus: as
    rebalance_experts. old_phy2log: [L, P] placement in force (None: place afresh).
    option_fields: HistoryOptions fields (interval, step_cost, slot_cost, margin, ...),
    or options: one HistoryOptions (not both; unknown fields raise naming them).
    Returns: phy2log [L, P], log2phy [L, E, max_replicas], logcnt [L, E] int64 CPU
    tensors; phy2log equals old_phy2log on every layer where staying pays better.
    Deterministic for the same input.
    """
    opt = _resolve_options(options, option_fields)
    decision = plan_from_history(history, num_replicas, num_groups, num_nodes, num_gpus,
                                 old_phy2log=old_phy2log, options=opt)
    phy2log = torch.from_numpy(np.ascontiguousarray(decision.phy2log, dtype=np.int64))
    log2phy, logcnt = compute_log2phy(phy2log, as_numpy(history, "history", 3).shape[2])
    return phy2log, log2phy, logcnt

