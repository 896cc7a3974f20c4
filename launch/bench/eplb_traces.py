"""Expert-load traces for the EPLB series benchmark: generators and dump readers.

A trace is `[T, L, E]` tokens routed to each logical expert of each MoE layer at
each step. Generated ones draw, per step, Poisson(tokens x top_k x share x g) with g a
mean-one gamma factor whose coefficient of variation is the expert's own volatility
(most experts steady, a few volatile); the shares follow one of the kinds below,
built at a 8-step resolution.

  phases       workload phases (a new popularity every ~1,000-2,500 steps, related
               to the last) joined by crossfades of 64-512 steps
  bursts       a steady popularity with single experts flaring x4-x16 for 32-512 steps
  drift        popularity drifting slowly (a mean-reverting random walk of the logits)
  steady       one popularity for the whole trace (moving after the start is a waste)
  noisy-decode few tokens per step (64 x top-k): Poisson noise dominates, slow drift

Real traces: any expert-distribution dump `profile report` reads (this project's
safetensors, SGLang's `torch.save` dumps loaded with weights_only=True, `.npy`, `.npz`,
`.csv`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

KINDS = ("phases", "bursts", "drift", "steady", "noisy-decode")
MODELS = {"deepseek-r1": (58, 256, 8), "qwen3-moe": (94, 128, 8)}  # L, E, top-k
_RES = 8  # steps per point of the share curves


@dataclass(frozen=True)
class TraceSpec:
    """kind in KINDS, model in MODELS, num_gpus (EP size), num_steps; num_layers caps the
    model's layers (None: all); tokens per step (None: the kind's default)."""

    kind: str
    model: str
    num_gpus: int
    num_steps: int
    seed: int = 0
    num_layers: int | None = None
    tokens: int | None = None

    @property
    def name(self) -> str:
        layers = MODELS[self.model][0]
        shown = f"{self.num_layers}/{layers}L" if self.num_layers and self.num_layers < layers else f"{layers}L"
        return f"{self.kind}:{self.model}:{shown}:ep{self.num_gpus}:s{self.seed}"


def _logit_curves(kind: str, num_points: int, num_layers: int, num_experts: int,
                  rng: np.random.Generator) -> np.ndarray:
    """[num_points, L, E] log-popularity per point (_RES steps each)."""
    z0 = rng.normal(0.0, 1.0, (num_layers, num_experts))
    if kind == "steady":
        return np.broadcast_to(z0, (num_points, num_layers, num_experts))
    if kind in ("drift", "noisy-decode"):
        sigma = 0.03 if kind == "drift" else 0.015
        theta = 0.002
        z = np.empty((num_points, num_layers, num_experts))
        z[0] = z0
        for t in range(1, num_points):
            z[t] = z[t - 1] + theta * (z0 - z[t - 1]) + rng.normal(0.0, sigma, z0.shape)
        return z
    if kind == "bursts":
        z = np.repeat(z0[None], num_points, 0).copy()
        num_bursts = max(1, num_points * _RES // 400) * num_layers
        for _ in range(num_bursts):
            layer, expert = rng.integers(num_layers), rng.integers(num_experts)
            start = rng.integers(num_points)
            length = max(1, int(rng.integers(32, 513)) // _RES)
            z[start:start + length, layer, expert] += np.log(rng.uniform(4.0, 16.0))
        return z
    if kind == "phases":
        shares, edges = [], [0]
        while edges[-1] < num_points:
            edges.append(edges[-1] + int(rng.integers(1000, 2501)) // _RES)
        popularity = z0
        for _ in range(len(edges) - 1):
            shares.append(popularity)
            popularity = 0.4 * popularity + 0.9 * rng.normal(0.0, 1.0, z0.shape)
        p = np.stack([_softmax(s) for s in shares])  # [phases, L, E]
        out = np.empty((num_points, num_layers, num_experts))
        for k in range(len(edges) - 1):
            out[edges[k]:edges[k + 1]] = p[k]
            if k + 1 < len(p):
                width = int(rng.integers(64, 513)) // _RES
                lo, hi = max(edges[k + 1] - width // 2, 0), min(edges[k + 1] + width - width // 2, num_points)
                a = np.linspace(0.0, 1.0, hi - lo)[:, None, None]
                out[lo:hi] = (1 - a) * p[k] + a * p[k + 1]
        return np.log(np.maximum(out, 1e-12))
    raise ValueError(f"unknown trace kind {kind!r}; expected one of {KINDS}")


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def make_trace(spec: TraceSpec) -> np.ndarray:
    """[T, L, E] int32 tokens per logical expert per step for a generated trace."""
    if spec.kind not in KINDS:
        raise ValueError(f"unknown trace kind {spec.kind!r}; expected one of {KINDS}")
    if spec.model not in MODELS:
        raise ValueError(f"unknown model shape {spec.model!r}; expected one of {sorted(MODELS)}")
    num_layers, num_experts, top_k = MODELS[spec.model]
    num_layers = min(num_layers, spec.num_layers or num_layers)
    tokens = spec.tokens or (64 if spec.kind == "noisy-decode" else 4096)
    rng = np.random.default_rng([spec.seed, KINDS.index(spec.kind), num_experts, spec.num_gpus])
    num_points = -(-spec.num_steps // _RES)
    curves = _logit_curves(spec.kind, num_points, num_layers, num_experts, rng)
    volatility = np.clip(0.1 * rng.lognormal(0.0, 0.8, (num_layers, num_experts)), 0.02, 1.5)
    shape_k = 1.0 / volatility ** 2
    out = np.empty((spec.num_steps, num_layers, num_experts), dtype=np.int32)
    chunk = 512
    for start in range(0, spec.num_steps, chunk):
        stop = min(start + chunk, spec.num_steps)
        share = _softmax(curves[start // _RES:-(-stop // _RES)])
        share = np.repeat(share, _RES, 0)[start % _RES:start % _RES + stop - start]
        g = rng.gamma(shape_k, 1.0 / shape_k, (stop - start, num_layers, num_experts))
        out[start:stop] = rng.poisson(tokens * top_k * share * g)
    return out


def trace_files(spec: str | Path) -> list[str]:
    """The files one ``--trace`` names: itself when it is a file or holds no comma, else its
    comma-separated parts (the files of one dump, an SGLang per_pass dump's rank files)."""
    return [str(spec)] if Path(spec).exists() or "," not in str(spec) else str(spec).split(",")


def load_trace(path: str | Path) -> np.ndarray:
    """`logical_count [T, L, E]` from an expert-distribution dump in any format `profile report`
    reads (this project's safetensors, SGLang's stat / per_pass `torch.save` dumps, `.npy`, `.npz`,
    `.csv`); ``"a.pt,b.pt"`` (``trace_files``) names the files of one dump, read together as
    `profile report` reads them (an SGLang per_pass dump's rank files: one missing is an error naming
    it). Returns int64 numpy where the counts are integral, else float64; ValueError naming the file
    otherwise."""
    from launch.profile.readers import DumpError, read_recording

    try:
        count = read_recording(trace_files(path)).logical_count
    except DumpError as exc:
        raise ValueError(f"trace {exc}") from None
    if count.shape[0] < 2:
        raise ValueError(f"trace {path}: logical_count must be [steps >= 2, L, E], got {tuple(count.shape)}")
    return count.astype(np.int64) if np.array_equal(count, np.round(count)) else count
