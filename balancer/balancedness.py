"""Balancedness: per layer mean rank load / max rank load; overall
sum over layers of the mean / sum of the max. 1.0 is perfect; an idle layer counts
as perfectly balanced.

Shape legend: L layers, E logical experts, P physical slots, R ranks (GPUs).
Slot p lives on rank p // (P / R).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def as_numpy(x: torch.Tensor | np.ndarray, name: str, ndim: int) -> np.ndarray:
    """Tensor or array -> numpy view, checking the number of dimensions."""
    arr = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(arr.shape)}")
    return arr


def compute_balancedness(rank_load: torch.Tensor | np.ndarray) -> tuple[torch.Tensor, float]:
    """rank_load: [L, R] tokens per rank per layer.
    Returns: (per_layer [L] float64 in [0, 1], overall float)."""
    load = as_numpy(rank_load, "rank_load", 2).astype(np.float64)
    mean, peak = load.mean(1), load.max(1)
    per_layer = np.where(peak > 0, mean / np.where(peak > 0, peak, 1.0), 1.0)
    overall = float(mean.sum() / peak.sum()) if peak.sum() > 0 else 1.0
    return torch.from_numpy(per_layer), overall


def rank_load_of_slots(slot_load: torch.Tensor | np.ndarray, num_ranks: int) -> np.ndarray:
    """slot_load: [L, P] -> [L, R] float64 (contiguous blocks of P / R slots per rank)."""
    load = as_numpy(slot_load, "slot_load", 2)
    num_layers, num_slots = load.shape
    if num_ranks <= 0 or num_slots % num_ranks:
        raise ValueError(f"{num_slots} slots cannot be split evenly over {num_ranks} ranks")
    return load.astype(np.float64).reshape(num_layers, num_ranks, -1).sum(-1)


def slot_load_of_experts(load: np.ndarray, phy2log: np.ndarray) -> np.ndarray:
    """Expected tokens per slot when each expert's load is split equally among its
    replicas. load: [L, E]; phy2log: [L, P] -> [L, P] float64."""
    num_layers, num_experts = load.shape
    if phy2log.shape[0] != num_layers:
        raise ValueError(f"load has {num_layers} layers but phy2log has {phy2log.shape[0]}")
    if phy2log.min() < 0 or phy2log.max() >= num_experts:
        raise ValueError(f"phy2log holds expert ids outside [0, {num_experts})")
    counts = np.zeros((num_layers, num_experts), dtype=np.float64)
    np.add.at(counts, (np.arange(num_layers)[:, None], phy2log), 1.0)
    _check_covered(load, counts)
    share = load.astype(np.float64) / np.maximum(counts, 1.0)
    return np.take_along_axis(share, phy2log, 1)


def _check_covered(load: np.ndarray, counts: np.ndarray) -> None:
    """ValueError naming the first expert with load ([L, E]) but no slot (counts [L, E] copies per
    expert): a placement that leaves it out would drop its tokens from every rank's load."""
    missing = (counts == 0) & (load > 0)
    if missing.any():
        layer, expert = (int(i) for i in np.argwhere(missing)[0])
        raise ValueError(f"phy2log gives expert {expert} of layer {layer} no slot, but it has load "
                         f"{float(load[layer, expert]):g}: every expert with load needs a copy")


@dataclass(frozen=True)
class Prediction:
    """What a placement would do to a given load.

    per_layer: [L] float64 balancedness; overall: float; rank_load: [L, R] float64
    expected tokens per rank (each expert's load split equally among its replicas).
    """

    per_layer: torch.Tensor
    overall: float
    rank_load: torch.Tensor

    def worst_layers(self, n: int = 5) -> list[tuple[int, float]]:
        """The n least balanced layers as (layer, balancedness), worst first."""
        order = torch.argsort(self.per_layer, stable=True)[:n]
        return [(int(i), float(self.per_layer[i])) for i in order]


def predict(load: torch.Tensor | np.ndarray, phy2log: torch.Tensor | np.ndarray, num_gpus: int) -> Prediction:
    """Balancedness a placement would reach on a load, before applying it.

    load: [L, E] tokens per logical expert; phy2log: [L, P] int, P % num_gpus == 0.
    """
    load_np = as_numpy(load, "load", 2)
    phy = as_numpy(phy2log, "phy2log", 2).astype(np.int64)
    ranks = rank_load_of_slots(slot_load_of_experts(load_np, phy), num_gpus)
    per_layer, overall = compute_balancedness(ranks)
    return Prediction(per_layer=per_layer, overall=overall, rank_load=torch.from_numpy(ranks))


def compute_par(load: np.ndarray, phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    """Peak-to-average ratio per step and layer (the load-balancing competition's metric).

    load: [S, L, E] tokens per logical expert per step (a replicated expert's load is
    split evenly over its copies); phy2log: [L, P], P % num_gpus == 0.
    Returns: [S, L] float64 max GPU load / mean GPU load; 1.0 where a layer is idle.
    """
    load = np.asarray(load, dtype=np.float64)
    phy = np.asarray(phy2log, dtype=np.int64)
    num_steps, num_layers, num_experts = load.shape
    if phy.shape[0] != num_layers or phy.shape[1] % num_gpus:
        raise ValueError(f"phy2log {phy.shape} does not fit load {load.shape} on {num_gpus} GPUs")
    if phy.size and (phy.min() < 0 or phy.max() >= num_experts):
        raise ValueError(f"phy2log holds expert ids outside [0, {num_experts})")
    counts = np.zeros((num_layers, num_experts), dtype=np.float64)
    np.add.at(counts, (np.arange(num_layers)[:, None], phy), 1.0)
    if num_steps and (counts == 0).any():  # only then is the [S, L, E] load read for it
        _check_covered(load.max(0), counts)
    share = (load / np.maximum(counts, 1.0)).reshape(num_steps, -1)  # [S, L * E] load of one copy
    flat = (np.arange(num_layers)[:, None] * num_experts + phy).ravel()  # [L * P] into L * E
    slot = np.take(share, flat, axis=1)  # [S, L * P]
    gpu = slot.reshape(num_steps, num_layers, num_gpus, phy.shape[1] // num_gpus).sum(-1)
    mean = gpu.mean(-1)
    return np.where(mean > 0, gpu.max(-1) / np.where(mean > 0, mean, 1.0), 1.0)
