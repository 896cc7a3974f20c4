"""Forecasting expert load from a history window.

`forecast_load(history, horizon)` predicts the mean load per logical expert over the
next `horizon` steps from `history [W, L, E]` (per-step loads, oldest first):

  Step 1: block means (b steps each) make every later step O(W / b);
  Step 2: recency: exponentially weighted means for half-lives 8 .. 2048 steps, and for
          each a trend-corrected variant (the slope from two half-lives, projected to
          the middle of the horizon);
  Step 3: adaptive half-life: per layer, the candidate whose forecasts made from
          earlier cut points best predicted the horizon that followed them (squared
          error of the layer's load shares, backtested on up to four cuts);
  Step 4: bursts: an expert whose last few steps sit far above (or below) the chosen
          forecast, by more than `burst_sigmas` standard errors of its own step
          noise, takes its recent level (a burst or a drop that has already begun);
  Step 5: volatility: each expert's per-step standard deviation around its local
          level (the noise the placement must absorb every step).

Shape legend: W history steps, L layers, E logical experts, H half-life candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HALF_LIVES = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_NUM_CUTS = 4


@dataclass(frozen=True)
class Forecast:
    """mean: [L, E] predicted load per step over the horizon; std: [L, E] per-step
    standard deviation around the local level; half_life: [L] steps of the chosen
    recency (0: trend variant of the same half-life is flagged by `trend` [L] bool);
    residuals: [S, L, E] recent per-step deviations from the local level (zero mean),
    for sampling what a step around `mean` may look like."""

    mean: np.ndarray
    std: np.ndarray
    half_life: np.ndarray
    trend: np.ndarray
    residuals: np.ndarray


def _shares(x: np.ndarray) -> np.ndarray:
    """[S, L, E] loads -> float64 shares of each step's layer total (an idle layer-step: uniform).
    PAR is scale-free per step, so every step counts alike, prefill or decode."""
    x = x.astype(np.float64)
    total = x.sum(-1, keepdims=True)
    return np.where(total > 0, x / np.where(total > 0, total, 1.0), 1.0 / x.shape[-1])


def _block_size(num_steps: int) -> int:
    return int(max(1, min(8, num_steps // 32)))


def _weights(ages: np.ndarray, half_lives: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """ages [B] (steps before the cut, of each block's centre), valid [C, B] -> [C, H, B] normalised."""
    w = np.exp2(-ages[None, None, :] / half_lives[None, :, None]) * valid[:, None, :]
    return w / np.maximum(w.sum(-1, keepdims=True), 1e-300)


def forecast_load(history: np.ndarray, horizon: int, *, burst_sigmas: float = 4.0,
                  burst_steps: int = 16) -> Forecast:
    """history: [W, L, E] per-step loads (W >= 1), oldest first; horizon: steps to forecast.
    Every step is first turned into shares of its layer's total (PAR is scale-free).
    Returns: Forecast of the shares (mean [L, E] >= 0, std [L, E], half_life [L], trend [L],
    residuals [S, L, E])."""
    raw = np.asarray(history)  # any real dtype; turned into shares slice by slice
    num_steps, num_layers, num_experts = raw.shape
    horizon = max(1, int(horizon))

    def hist_slice(a: int, b: int) -> np.ndarray:
        return _shares(raw[a:b])

    # Step 1: block means, newest block last (drop the oldest partial block).
    b = _block_size(num_steps)
    nb = num_steps // b
    first = num_steps - nb * b
    part = raw[first:].reshape(nb, b, num_layers, num_experts)
    total = part.sum(-1, dtype=np.float64)  # [B, b, L]
    inv = np.where(total > 0, 1.0 / np.where(total > 0, total, 1.0), 0.0)
    blocks = np.einsum("kble,kbl->kle", part, inv) / b  # [B, L, E] mean shares
    blocks += ((total == 0).sum(1) / (b * num_experts))[..., None]  # idle steps count as uniform
    flat = blocks.reshape(nb, -1)
    centre = (nb - np.arange(nb) - 0.5) * b  # age of each block's centre at the end of the window
    # Step 2: candidates at the cut points "now" (index 0) and horizon*j steps ago.
    cuts_back = [0] + [horizon * j for j in range(1, _NUM_CUTS + 1) if horizon * j + 2 * b <= num_steps]
    half = np.array([h for h in HALF_LIVES if h <= max(8, 2 * num_steps)], dtype=np.float64)
    ages = np.stack([centre - c for c in cuts_back])  # [C, B]
    valid = (ages > 0).astype(np.float64)
    wts = np.stack([_weights(ages[i], half, valid[i:i + 1])[0] for i in range(len(cuts_back))])  # [C, H, B]
    level = (wts.reshape(-1, nb) @ flat).reshape(len(cuts_back), len(half), -1)  # [C, H, L*E]
    mean_age = np.einsum("chb,cb->ch", wts, np.maximum(ages, 0))  # [C, H]
    cands = [level]
    if len(half) > 1:
        # Trend: level_h - level_2h = slope * (age_2h - age_h); project to the horizon's middle.
        gap = np.maximum(mean_age[:, 1:] - mean_age[:, :-1], 1e-9)[..., None]
        slope = (level[:, :-1] - level[:, 1:]) / gap
        ahead = (mean_age[:, :-1] + horizon / 2)[..., None]
        cands.append(np.maximum(level[:, :-1] + slope * ahead, 0.0))
    cand = np.concatenate(cands, 1).reshape(len(cuts_back), -1, num_layers, num_experts)  # [C, K, L, E]
    num_half = len(half)
    # Step 3: per layer, the candidate with the least backtest error on the shares.
    pick = np.zeros(num_layers, dtype=np.int64)
    if len(cuts_back) > 1:
        err = np.zeros((cand.shape[1], num_layers))
        for i, back in enumerate(cuts_back[1:], start=1):
            end = num_steps - back
            if horizon % b == 0 and (end - first) % b == 0:  # whole blocks: reuse their means
                k = (end - first) // b
                actual = blocks[k:k + horizon // b].mean(0)  # [L, E]
            else:
                actual = hist_slice(end, end + horizon).mean(0)
            total = np.maximum(actual.sum(-1, keepdims=True), 1e-12)
            pred = cand[i] / np.maximum(cand[i].sum(-1, keepdims=True), 1e-12)
            err += ((pred - actual / total) ** 2).sum(-1)
        pick = err.argmin(0)
    mean = np.take_along_axis(cand[0], pick[None, :, None], 0)[0]  # [L, E]
    # Step 5 first (Step 4 needs it): per-step noise around the local (block) level.
    recent = min(num_steps, 256) // b * b
    if recent >= 2 * b and b > 1:
        tail = hist_slice(num_steps - recent, num_steps)
        local = tail.reshape(-1, b, num_layers, num_experts).mean(1, keepdims=True)
        resid = (tail.reshape(-1, b, num_layers, num_experts) - local).reshape(recent, num_layers, num_experts)
        std = np.sqrt((resid ** 2).mean(0) * b / (b - 1))
    else:
        tail = hist_slice(max(0, num_steps - 256), num_steps)
        resid = tail - tail.mean(0)
        std = tail.std(0) if len(tail) > 1 else np.zeros((num_layers, num_experts))
    # Step 4: bursts and drops already under way.
    n = min(burst_steps, num_steps)
    if n < num_steps:
        short = hist_slice(num_steps - n, num_steps).mean(0)
        sigma = np.maximum(std, 1e-3 / num_experts) / np.sqrt(n)
        jump = np.abs(short - mean) > burst_sigmas * sigma
        mean = np.where(jump, short, mean)
    return Forecast(mean=np.maximum(mean, 0.0), std=std,
                    half_life=half[pick % num_half] if len(half) else np.zeros(num_layers),
                    trend=pick >= num_half, residuals=resid[-64:])
