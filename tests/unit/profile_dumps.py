"""Dumps the profile tests write themselves, in the documented formats, plus an independent
oracle for the numbers the report should give (plain loops and reshapes, not the profiler's code)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def skewed_counts(steps: int, num_layers: int, num_experts: int, seed: int = 0, tokens: int = 48) -> np.ndarray:
    """[S, L, E] int64 counts from a skewed router whose preferences switch halfway."""
    rng = np.random.default_rng(seed)
    first = rng.dirichlet(np.full(num_experts, 0.4), size=num_layers)
    second = rng.dirichlet(np.full(num_experts, 0.4), size=num_layers)
    return np.stack([np.stack([rng.multinomial(tokens, (first if s < steps // 2 else second)[x])
                               for x in range(num_layers)]) for s in range(steps)]).astype(np.int64)


def write_sglang_stat(path: Path, count: np.ndarray, empty_tail: int = 0) -> Path:
    """SGLang ``stat`` mode: {"rank", "logical_count" [S, L, E] int32, "average_utilization_rate_over_window"};
    ``empty_tail`` zero steps appended (the unfilled ring buffer)."""
    full = np.concatenate([count, np.zeros((empty_tail, *count.shape[1:]), dtype=count.dtype)])
    torch.save({"rank": 0, "logical_count": torch.from_numpy(full).to(torch.int32),
                "average_utilization_rate_over_window": None}, str(path))
    return path


def write_sglang_per_pass(path: Path, physical: np.ndarray, phy2log: np.ndarray, rank: int,
                          pass_ids: list[int]) -> Path:
    """SGLang ``per_pass`` mode: {"records": [{"forward_pass_id", "rank", "gatherer_key",
    "global_physical_count" [L, P]}], "last_physical_to_logical_map" [L, P]}."""
    records = [{"forward_pass_id": pid, "rank": rank, "gatherer_key": "primary",
                "global_physical_count": torch.from_numpy(physical[i]).to(torch.int32)}
               for i, pid in enumerate(pass_ids)]
    torch.save({"records": records, "last_physical_to_logical_map": torch.from_numpy(phy2log)}, str(path))
    return path


def oracle_balancedness(rank_load: np.ndarray) -> tuple[list[float], float]:
    """rank_load [L, R] -> per layer mean/max, overall sum(mean)/sum(max) (loops)."""
    per_layer, means, maxes = [], 0.0, 0.0
    for row in rank_load:
        m, peak = float(np.mean(row)), float(np.max(row))
        per_layer.append(m / peak if peak > 0 else 1.0)
        means += m
        maxes += peak
    return per_layer, means / maxes


def oracle_identity_rank_load(load: np.ndarray, ep: int) -> np.ndarray:
    """load [L, E] -> [L, ep], expert e on rank e // (E / ep)."""
    num_layers, num_experts = load.shape
    per = num_experts // ep
    out = np.zeros((num_layers, ep))
    for x in range(num_layers):
        for e in range(num_experts):
            out[x, e // per] += load[x, e]
    return out


def oracle_hot(load: np.ndarray, n: int = 5) -> tuple[list[list[int]], list[list[float]]]:
    ids, shares = [], []
    for row in load:
        order = sorted(range(len(row)), key=lambda e: (-row[e], e))[:n]
        ids.append(order)
        shares.append([float(row[e]) / float(row.sum()) for e in order])
    return ids, shares


def write_csv(path: Path, count: np.ndarray, encoding: str = "utf-8") -> Path:
    """The documented CSV: header ``step,layer,e0,...``, one row per (step, layer)."""
    steps, num_layers, num_experts = count.shape
    lines = ["step,layer," + ",".join(f"e{e}" for e in range(num_experts))]
    lines += [f"{s},{x}," + ",".join(str(v) for v in count[s, x]) for s in range(steps) for x in range(num_layers)]
    path.write_text("\n".join(lines) + "\n", encoding=encoding)
    return path


def record_our_dump(directory: Path, slot_loads: list[np.ndarray], num_experts: int, num_gpus: int,
                    metadata: dict[str, str] | None = None) -> Path:
    """This runtime's dump as the server writes it: an ``EplbDriver`` on the identity placement
    records each [L, P] slot load (P = num_experts) as one step; an empty list gives a 0-step dump."""
    from balancer import BalancerConfig, Placement
    from launch.balancing import EplbDriver

    num_layers = slot_loads[0].shape[0] if slot_loads else 2
    driver = EplbDriver(BalancerConfig(), Placement.identity(num_layers, num_experts, 0, num_gpus), num_groups=1,
                        num_nodes=1, expert_bytes=1)
    driver.start_record()
    for load in slot_loads:
        driver.record(torch.from_numpy(np.asarray(load)), None)
    driver.stop_record()
    return driver.dump_record(directory, metadata=metadata)
