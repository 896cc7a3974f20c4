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
    """mean: [L, E] predicted share of each expert per step over the horizon; std: [L, E]
    per-step standard deviation of the share around its local level; half_life: [L]
    steps of the chosen recency; trend: [L] bool, the trend-corrected variant was chosen;
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
    if (total > 0).all():
        return np.divide(x, total, out=x)
    return np.where(total > 0, x / np.where(total > 0, total, 1.0), 1.0 / x.shape[-1])


def _block_size(num_steps: int) -> int:
    return int(max(1, min(8, num_steps // 32)))


def _weights(ages: np.ndarray, half_lives: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """ages [B] (steps before the cut, of each block's centre), valid [C, B] -> [C, H, B] normalised."""
    w = np.exp2(-ages[None, None, :] / half_lives[None, :, None]) * valid[:, None, :]
    return w / np.maximum(w.sum(-1, keepdims=True), 1e-300)


def _block_shares(raw: np.ndarray, b: int) -> tuple[np.ndarray, int]:
    """raw [W, L, E] -> (mean shares of each whole b-step block [B, L, E], newest last;
    first: the step the first block starts at, the oldest partial block dropped)."""
    num_steps, num_layers, num_experts = raw.shape
    nb = num_steps // b
    first = num_steps - nb * b
    part = raw[first:].reshape(nb, b, num_layers, num_experts)
    total = part.sum(-1, dtype=np.float64)  # [B, b, L]
    inv = np.where(total > 0, 1.0 / np.where(total > 0, total, 1.0), 0.0)
    blocks = np.einsum("kble,kbl->kle", part, inv) / b
    blocks += ((total == 0).sum(1) / (b * num_experts))[..., None]  # idle steps count as uniform
    return blocks, first


def _recency_candidates(blocks: np.ndarray, b: int, horizon: int, cuts_back: list[int],
                        half: np.ndarray) -> np.ndarray:
    """EWMA per half-life and its trend-corrected variant, made at each cut (steps back
    from the end). Returns: [C, K, L, E], K = H plain then H - 1 trend candidates."""
    nb, num_layers, num_experts = blocks.shape
    centre = (nb - np.arange(nb) - 0.5) * b  # age of each block's centre at the end of the window
    ages = np.stack([centre - c for c in cuts_back])  # [C, B]
    valid = (ages > 0).astype(np.float64)
    wts = np.stack([_weights(ages[i], half, valid[i:i + 1])[0] for i in range(len(cuts_back))])  # [C, H, B]
    level = (wts.reshape(-1, nb) @ blocks.reshape(nb, -1)).reshape(len(cuts_back), len(half), -1)
    cands = [level]
    if len(half) > 1:
        # Trend: level_h - level_2h = slope * (age_2h - age_h); project to the horizon's middle.
        mean_age = np.einsum("chb,cb->ch", wts, np.maximum(ages, 0))  # [C, H]
        gap = np.maximum(mean_age[:, 1:] - mean_age[:, :-1], 1e-9)[..., None]
        slope = (level[:, :-1] - level[:, 1:]) / gap
        ahead = (mean_age[:, :-1] + horizon / 2)[..., None]
        cands.append(np.maximum(level[:, :-1] + slope * ahead, 0.0))
    return np.concatenate(cands, 1).reshape(len(cuts_back), -1, num_layers, num_experts)


def _backtest_pick(cand: np.ndarray, raw: np.ndarray, blocks: np.ndarray, first: int, b: int, horizon: int,
                   cuts_back: list[int]) -> np.ndarray:
    """Per layer, the candidate whose forecasts from the earlier cuts best predicted the
    `horizon` steps after each (squared error of the shares). Returns: pick [L] int64."""
    num_steps, num_layers = raw.shape[:2]
    if len(cuts_back) < 2:
        return np.zeros(num_layers, dtype=np.int64)
    err = np.zeros((cand.shape[1], num_layers))
    for i, back in enumerate(cuts_back[1:], start=1):
        end = num_steps - back
        if horizon % b == 0 and (end - first) % b == 0:  # whole blocks: reuse their means
            k = (end - first) // b
            actual = blocks[k:k + horizon // b].mean(0)  # [L, E]
        else:
            actual = _shares(raw[end:end + horizon]).mean(0)
        total = np.maximum(actual.sum(-1, keepdims=True), 1e-12)
        pred = cand[i] / np.maximum(cand[i].sum(-1, keepdims=True), 1e-12)
        err += ((pred - actual / total) ** 2).sum(-1)
    return err.argmin(0)


def _step_noise(raw: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-step deviations of the shares around their local (b-step block) level over the
    last <= 256 steps. Returns: (std [L, E], residuals [S, L, E])."""
    num_steps, num_layers, num_experts = raw.shape
    recent = min(num_steps, 256) // b * b
    if recent >= 2 * b and b > 1:
        tail = _shares(raw[num_steps - recent:]).reshape(-1, b, num_layers, num_experts)
        resid = (tail - tail.mean(1, keepdims=True)).reshape(recent, num_layers, num_experts)
        return np.sqrt((resid ** 2).mean(0) * b / (b - 1)), resid
    tail = _shares(raw[max(0, num_steps - 256):])
    std = tail.std(0) if len(tail) > 1 else np.zeros((num_layers, num_experts))
    return std, tail - tail.mean(0)


def forecast_load(history: np.ndarray, horizon: int, *, burst_sigmas: float = 4.0,
                  burst_steps: int = 16) -> Forecast:
    """history: [W, L, E] per-step loads (W >= 1, any real dtype), oldest first; horizon:
    steps to forecast. Every step is first turned into shares of its layer's total (PAR
    is scale-free). Returns: Forecast of the shares (mean [L, E] >= 0, std [L, E],
    half_life [L], trend [L], residuals [S, L, E])."""
    raw = np.asarray(history)
    num_steps, num_layers, num_experts = raw.shape
    horizon = max(1, int(horizon))
    # Step 1.
    b = _block_size(num_steps)
    blocks, first = _block_shares(raw, b)
    # Steps 2-3: candidates at the cut points "now" (index 0) and horizon * j steps ago.
    cuts_back = [0] + [horizon * j for j in range(1, _NUM_CUTS + 1) if horizon * j + 2 * b <= num_steps]
    half = np.array([h for h in HALF_LIVES if h <= max(8, 2 * num_steps)], dtype=np.float64)
    cand = _recency_candidates(blocks, b, horizon, cuts_back, half)
    pick = _backtest_pick(cand, raw, blocks, first, b, horizon, cuts_back)
    mean = np.take_along_axis(cand[0], pick[None, :, None], 0)[0]  # [L, E]
    # Step 5 (Step 4 needs it), then Step 4: bursts and drops already under way.
    std, resid = _step_noise(raw, b)
    n = min(burst_steps, num_steps)
    if n < num_steps:
        short = _shares(raw[num_steps - n:]).mean(0)
        sigma = np.maximum(std, 1e-3 / num_experts) / np.sqrt(n)
        mean = np.where(np.abs(short - mean) > burst_sigmas * sigma, short, mean)
    return Forecast(mean=np.maximum(mean, 0.0), std=std, half_life=half[pick % len(half)],
                    trend=pick >= len(half), residuals=resid[-64:])
