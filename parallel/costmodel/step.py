"""One decode or prefill step of one serving instance, as a sum of named operator costs.

Per decoder layer on the busiest rank: attention projections and the attention core on
the rank's DP slice (heads split over TP), TP collectives, then the FFN: a dense MLP on
dense layers; on MoE layers the router, shared experts, the busiest EP rank's routed
expert GEMMs, and the dispatch + combine hops. With two-batch overlap the step runs as
two half batches whose communication hides behind the other half's compute (each MoE
layer costs max(compute, communication) of the two halves together). Per-layer and
per-step fixed overheads come from the hardware (measured by ``simulate calibrate``).

All times are seconds inside, milliseconds in ``PhasePrediction``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moe.config import ModelConfig
from parallel.costmodel.deployment import Deployment
from parallel.costmodel.experts import RankLoad, busiest_rank_rows
from parallel.costmodel.hardware import Hardware
from parallel.costmodel.ops import (
    allgather_seconds,
    allreduce_seconds,
    alltoall_seconds,
    attention_core_cost,
    attention_projection_cost,
    gemm_cost,
    mlp_cost,
)

COMM_KEYS = ("dispatch", "combine")
ELEMENTWISE_PASSES = 10
ELEMENTWISE_KERNELS = 6


@dataclass(frozen=True)
class AttentionWork:
    """One DP rank's attention work in a step: query tokens, sum of attended keys over
    queries, cached tokens read from the KV cache, tokens whose MLA latent is expanded
    (prefill), and rows that reach the lm_head (one per sequence)."""

    tokens: float
    attended_pairs: float
    kv_read_tokens: float
    expanded_tokens: float
    logits_rows: float


def decode_work(batch_size: int, kv_len: int, sliding_window: int | None = None) -> AttentionWork:
    """B sequences each decoding one token over a context of kv_len tokens (with a sliding
    window w, over its last min(kv_len, w): the runtime reads no blocks before the window)."""
    seen = kv_len if sliding_window is None else min(kv_len, sliding_window)
    return AttentionWork(batch_size, batch_size * seen, batch_size * seen, 0.0, batch_size)


def _keys_seen(first: int, last: int, window: int | None) -> float:
    """Sum over query positions p = first..last (1-based: p keys up to and including its own) of
    the keys each sees: p, or min(p, window)."""
    if window is None or last <= window:
        return (first + last) * (last - first + 1) / 2
    if first >= window:
        return (last - first + 1) * window
    return (first + window) * (window - first + 1) / 2 + (last - window) * window


def prefill_work(num_tokens: int, prompt_len: int, prefix_len: int = 0,
                 sliding_window: int | None = None) -> AttentionWork:
    """num_tokens new tokens from prompts of prompt_len tokens whose first prefix_len are
    cached (prefix hits): each prompt computes n = prompt_len - prefix_len causal tokens. With
    a sliding window w each token sees its last w keys, and the cached tokens read are the
    last w - 1 of the prefix."""
    n = max(1, prompt_len - prefix_len)
    seqs = num_tokens / n
    pairs = seqs * _keys_seen(prefix_len + 1, prefix_len + n, sliding_window)
    cached = prefix_len if sliding_window is None else min(prefix_len, sliding_window - 1)
    return AttentionWork(num_tokens, pairs, seqs * cached, num_tokens + seqs * cached, max(1.0, seqs))


@dataclass(frozen=True)
class PhasePrediction:
    """step_ms and its breakdown (ms per operator over all layers; sums to step_ms;
    ``overlap_hidden`` is the negative time two-batch overlap hides). bound: the largest
    part. dropped_fraction: routed rows over capacity."""

    step_ms: float
    breakdown: dict[str, float]
    tokens: float
    bound: str
    dropped_fraction: float = 0.0


def _dense_layer_costs(cfg: ModelConfig, dep: Deployment, hw: Hardware, work: AttentionWork, decode: bool
                       ) -> dict[str, float]:
    """Seconds of the per-layer parts every layer has (attention + TP all-reduce), plus the
    dense MLP as ``dense_mlp`` (used only on dense layers)."""
    g = dict(dtype=dep.gemm_dtype, weight_bytes=dep.weight_bytes, act_bytes=dep.act_bytes)
    t, tp = work.tokens, dep.tp
    proj = attention_projection_cost(hw, cfg, t, tp, decode=decode, kv_tokens=work.expanded_tokens, **g)
    core = attention_core_cost(hw, cfg, tp, query_tokens=t, attended_pairs=work.attended_pairs,
                               kv_read_tokens=work.kv_read_tokens, dtype=dep.dtype, kv_bytes=dep.kv_bytes,
                               decode=decode)
    inter = tp > dep.ranks_per_node
    ar = allreduce_seconds(hw, t * cfg.hidden_size * dep.act_bytes, tp, inter_node=inter)
    dense = mlp_cost(hw, t, cfg.hidden_size, max(1, cfg.intermediate_size // tp), **g)
    # norms, residual adds, rope, activation quantisation: ~10 passes over [T, D] per layer
    elementwise = t * ELEMENTWISE_PASSES * cfg.hidden_size * dep.act_bytes / hw.effective_memory_bandwidth
    return {"attention_proj": proj.seconds, "attention_core": core.seconds, "tp_collectives": ar,
            "dense_mlp": dense.seconds + ar, "elementwise": elementwise + ELEMENTWISE_KERNELS * hw.kernel_overhead_s}


def _dispatch_seconds(cfg: ModelConfig, dep: Deployment, hw: Hardware, src_tokens: float, recv_rows: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(dispatch, combine) seconds per MoE layer for one EP rank that sends src_tokens and
    receives recv_rows [L] deduplicated rows (alltoall: an AllToAll of the split sizes, then
    AllToAll-v of the rows), or the all-gather backend."""
    ep, d, k = dep.ep, cfg.hidden_size, cfg.num_experts_per_tok
    layers = recv_rows.shape[0]
    if ep <= 1 or dep.all2all_backend == "local":
        return np.zeros(layers), np.zeros(layers)
    inter = ep > dep.ranks_per_node
    if dep.all2all_backend == "allgather":
        gathered = ep * src_tokens * d
        t_d = allgather_seconds(hw, gathered * dep.wire_bytes, ep, inter_node=inter)
        t_c = allgather_seconds(hw, gathered * dep.act_bytes, ep, inter_node=inter)  # reduce-scatter, same volume
        return np.full(layers, t_d), np.full(layers, t_c)
    distinct = ep * (1.0 - (1.0 - 1.0 / ep) ** k)  # destination ranks per token (dedup)
    off_rank = (ep - 1) / ep
    nodes = max(1, ep // dep.ranks_per_node) if ep > dep.ranks_per_node else 1
    # Inter-node rows are deduplicated per destination node (DeepEP normal mode) and, with
    # node-limited routing (topk_group of n_group groups placed on nodes), capped by it.
    node_picks = min(k, cfg.topk_group) if cfg.n_group > 1 and cfg.n_group % nodes == 0 else k
    remote_nodes = (nodes - 1) * (1.0 - (1.0 - 1.0 / nodes) ** node_picks) if nodes > 1 else 0.0
    row = d * dep.wire_bytes + k * 12  # hidden vector + expert ids (int64) and weights (fp32)
    send_rows = src_tokens * distinct * off_rank
    recv = recv_rows * (distinct / k) * off_rank
    remote = min(1.0, remote_nodes / max(distinct * off_rank, 1e-9))
    counts = alltoall_seconds(hw, ep * 8, ep * 8, ep, remote_fraction=remote)  # split sizes go first
    disp = np.array([counts + alltoall_seconds(hw, send_rows * row, r * row, ep, remote_fraction=remote)
                     for r in recv])
    back = d * dep.act_bytes
    comb = np.array([alltoall_seconds(hw, r * back, send_rows * back, ep, remote_fraction=remote) for r in recv])
    return disp, comb


def _expert_seconds(cfg: ModelConfig, dep: Deployment, hw: Hardware, rows: np.ndarray, touched: np.ndarray
                    ) -> np.ndarray:
    """Grouped expert GEMMs (w13 [D -> 2I], w2 [I -> D]) of one rank per layer: rows [L]
    routed rows, touched [L] slots with work (their weights are read once)."""
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    out = np.zeros(rows.shape[0])
    for i, (m, s) in enumerate(zip(rows, touched)):
        if m <= 0:
            out[i] = 2 * hw.kernel_overhead_s
            continue
        per_slot = m / max(s, 1.0)
        flops = 6.0 * m * d * inter
        # weights of touched slots; activations in/out, SiLU x up, and the permutation into
        # and out of slot order (read + write D per row, twice)
        nbytes = s * 3 * d * inter * dep.weight_bytes + m * (6 * d + 3 * inter) * dep.act_bytes
        out[i] = max(flops / hw.gemm_rate(dep.gemm_dtype, per_slot), nbytes / hw.effective_memory_bandwidth)
        out[i] += 2 * hw.kernel_overhead_s
    return out


def _moe_layer_costs(cfg: ModelConfig, dep: Deployment, hw: Hardware, rank_load: RankLoad, t: float
                     ) -> tuple[dict[str, np.ndarray], float]:
    """Per MoE layer seconds [L_moe] of router, shared experts, routed experts, dispatch,
    combine and the TP all-gather; and the fraction of routed rows dropped by capacity."""
    g = dict(dtype=dep.gemm_dtype, weight_bytes=dep.weight_bytes, act_bytes=dep.act_bytes)
    tp, ep, k, d = dep.tp, dep.ep, cfg.num_experts_per_tok, cfg.hidden_size
    src = t / tp  # each TP rank dispatches its share of the (identical) tokens
    total_rows = ep * src * k
    cap = None
    if dep.capacity_factor > 0:
        slots = dep.num_slots(cfg.num_experts)
        cap = ep * math.ceil(dep.capacity_factor * k * src / slots)
    rows, touched, dropped = busiest_rank_rows(rank_load, total_rows, cap)
    n = rows.shape[0]
    router = gemm_cost(hw, src, cfg.num_experts, d, dtype=dep.dtype, weight_bytes=dep.act_bytes,
                       act_bytes=dep.act_bytes).seconds
    shared_inter = cfg.num_shared_experts * cfg.moe_intermediate_size // tp
    shared = mlp_cost(hw, t, d, shared_inter, **g).seconds if shared_inter else 0.0
    disp, comb = _dispatch_seconds(cfg, dep, hw, src, rows)
    gather = allgather_seconds(hw, t * d * dep.act_bytes, tp, inter_node=tp > dep.ranks_per_node)
    costs = {"router": np.full(n, router), "shared_experts": np.full(n, shared),
             "routed_experts": _expert_seconds(cfg, dep, hw, rows, touched), "dispatch": disp, "combine": comb,
             "tp_collectives": np.full(n, gather)}
    return costs, float(dropped.sum() / max(total_rows * n, 1e-9))


def predict_phase(cfg: ModelConfig, dep: Deployment, hw: Hardware, rank_load: RankLoad | None,
                  work: AttentionWork, *, decode: bool) -> PhasePrediction:
    """Step time of one phase (decode or prefill) for one DP rank's ``work``."""
    if work.tokens <= 0:
        return PhasePrediction(0.0, {}, 0.0, "idle")
    halves = 2 if dep.enable_two_batch_overlap and work.tokens >= 2 else 1
    part = AttentionWork(*(x / halves for x in (work.tokens, work.attended_pairs, work.kv_read_tokens,
                                                work.expanded_tokens, work.logits_rows)))
    base = _dense_layer_costs(cfg, dep, hw, part, decode)
    moe_ids = cfg.moe_layer_ids
    n_dense = cfg.num_hidden_layers - len(moe_ids)
    parts: dict[str, float] = {"attention_proj": 0.0, "attention_core": 0.0, "tp_collectives": 0.0,
                               "dense_mlp": n_dense * base["dense_mlp"] * halves}
    for key in ("attention_proj", "attention_core", "elementwise"):
        parts[key] = cfg.num_hidden_layers * base[key] * halves
    parts["tp_collectives"] = cfg.num_hidden_layers * base["tp_collectives"] * halves  # after attention
    dropped = 0.0
    hidden = 0.0
    if moe_ids:
        assert rank_load is not None, "a MoE model needs the expert rank load"
        moe, dropped = _moe_layer_costs(cfg, dep, hw, rank_load, part.tokens)
        for key, per_layer in moe.items():
            parts[key] = parts.get(key, 0.0) + float(per_layer.sum()) * halves
        if halves == 2:
            compute = (base["attention_proj"] + base["attention_core"] + base["tp_collectives"] + base["elementwise"]
                       + sum(moe[k] for k in moe if k not in COMM_KEYS)) * 2
            comm = (moe["dispatch"] + moe["combine"]) * 2
            hidden = -float(np.minimum(compute, comm).sum())
    lm = gemm_cost(hw, part.logits_rows, cfg.vocab_size // dep.tp, cfg.hidden_size, dtype=dep.dtype,
                   weight_bytes=dep.act_bytes, act_bytes=dep.act_bytes).seconds * halves
    parts["lm_head"] = lm
    seqs = work.logits_rows
    parts["layer_overhead"] = cfg.num_hidden_layers * (hw.layer_overhead_s + seqs * hw.layer_seq_overhead_s)
    parts["step_overhead"] = hw.step_overhead_s + seqs * hw.seq_overhead_s + hw.multi_rank_overhead(dep.multi_rank_kinds, dep.world_size)
    if hidden:
        parts["overlap_hidden"] = hidden
    step = sum(parts.values())
    bound = max((k for k in parts if parts[k] > 0), key=lambda k: parts[k])
    return PhasePrediction(step * 1e3, {k: v * 1e3 for k, v in parts.items()}, work.tokens, bound, dropped)
