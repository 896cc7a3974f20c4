"""``predict_point``: the cost model's answer for one layout at one batch on one hardware."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moe.config import ModelConfig
from parallel.costmodel.deployment import Deployment
from parallel.costmodel.experts import RankLoad, compute_rank_load, synthetic_expert_load
from parallel.costmodel.hardware import Hardware
from parallel.costmodel.memory import kv_capacity_tokens
from parallel.costmodel.step import PhasePrediction, decode_work, predict_phase, prefill_work


@dataclass(frozen=True)
class StepPrediction:
    """Predicted step times of one serving instance (per DP rank, the busiest rank bounds).

    decode_step_ms: one decode step of ``batch_size`` sequences per DP rank at ``kv_len``
    context; prefill_step_ms: one prefill step of ``prefill_tokens`` new tokens per DP rank.
    batch_size: the batch actually predicted (the request capped by max_num_seqs and by the
    KV tokens that fit, ``kv_capacity_tokens`` per rank). breakdown: ms per operator.
    balancedness: of the routed rows over EP ranks under the placement used (1.0 = even).
    """

    decode_step_ms: float
    prefill_step_ms: float
    decode_breakdown: dict[str, float]
    prefill_breakdown: dict[str, float]
    batch_size: int
    requested_batch_size: int
    prefill_tokens: int
    kv_len: int
    kv_capacity_tokens: int
    balancedness: float
    decode_bound: str
    prefill_bound: str
    dropped_fraction: float = 0.0
    limits: dict[str, Any] = field(default_factory=dict)

    @property
    def breakdown(self) -> dict[str, dict[str, float]]:
        return {"decode": self.decode_breakdown, "prefill": self.prefill_breakdown}

    @property
    def batch_limited_by(self) -> str | None:
        """'kv_capacity' or 'max_num_seqs' when the requested batch was cut, else None."""
        return self.limits.get("batch_limited_by")


def build_rank_load(cfg: ModelConfig, dep: Deployment, *, expert_load: np.ndarray | None = None,
                    placement: np.ndarray | None = None, load_skew: float = 0.0, seed: int = 0) -> RankLoad | None:
    """The busiest-rank view of ``expert_load`` ([L_moe, E] tokens per expert; None: a
    synthetic Zipf load of ``load_skew``) under the deployment's placement; None for a
    model without MoE layers. The placement uses the nodes the EP group spans."""
    num_moe = len(cfg.moe_layer_ids)
    if num_moe == 0:
        return None
    load = synthetic_expert_load(num_moe, cfg.num_experts, load_skew, seed) if expert_load is None else expert_load
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 2 or load.shape[1] != cfg.num_experts:
        raise ValueError(f"expert_load must be [L_moe, E=num_experts={cfg.num_experts}], got shape {load.shape}")
    if load.shape[0] != num_moe:  # e.g. a dump from another depth: cycle its layers
        load = load[np.arange(num_moe) % load.shape[0]]
    nodes = max(1, dep.ep // dep.ranks_per_node) if dep.ep > dep.ranks_per_node else 1
    return compute_rank_load(load, dep.num_slots(cfg.num_experts), dep.ep, enable_eplb=dep.enable_eplb,
                             num_groups=cfg.n_group, num_nodes=nodes, policy=dep.eplb_policy, placement=placement)


def _cap_batch(batch_size: int, kv_len: int, dep: Deployment, capacity: int) -> tuple[int, str | None]:
    fit = capacity // max(kv_len, 1)
    batch = min(batch_size, dep.max_num_seqs, fit)
    if batch >= batch_size:
        return batch, None
    return batch, "kv_capacity" if fit < min(batch_size, dep.max_num_seqs) else "max_num_seqs"


def predict_point(model: ModelConfig, deployment: Deployment, hardware: Hardware, *, batch_size: int,
                  kv_len: int, prefill_tokens: int | None = None, prompt_len: int | None = None,
                  prefix_len: int = 0, expert_load: np.ndarray | None = None, placement: np.ndarray | None = None,
                  load_skew: float = 0.0, rank_load: RankLoad | None = None) -> StepPrediction:
    """Predict decode and prefill step time of one layout.

    batch_size: decoding sequences per DP rank (capped by max_num_seqs and KV capacity);
    kv_len: context tokens per decoding sequence. prefill_tokens: new tokens per DP rank in
    one prefill step (default min(max_num_batched_tokens, batch_size x prompt_len));
    prompt_len: tokens per prompt (default kv_len), of which prefix_len are cache hits.
    expert_load: [L_moe, E] measured tokens per expert (None: synthetic, ``load_skew``);
    placement: [L_moe, P] phy2log to use instead of the balancer's; rank_load: a
    precomputed ``build_rank_load`` (reuse it across batch sizes).
    """
    if batch_size < 1 or kv_len < 1:
        raise ValueError(f"need batch_size >= 1 and kv_len >= 1, got {batch_size}, {kv_len}")
    capacity = kv_capacity_tokens(model, deployment, hardware.memory_bytes)
    batch, limited = _cap_batch(batch_size, kv_len, deployment, capacity)
    if rank_load is None:
        rank_load = build_rank_load(model, deployment, expert_load=expert_load, placement=placement,
                                    load_skew=load_skew)
    prompt = prompt_len or kv_len
    if not 0 <= prefix_len < prompt:
        raise ValueError(f"prefix_len must be in [0, prompt_len={prompt}), got {prefix_len}")
    if prefill_tokens is None:
        prefill_tokens = min(deployment.max_num_batched_tokens, max(batch, 1) * (prompt - prefix_len))
    decode: PhasePrediction = predict_phase(model, deployment, hardware, rank_load,
                                            decode_work(batch, kv_len, model.sliding_window), decode=True)
    prefill = predict_phase(model, deployment, hardware, rank_load,
                            prefill_work(prefill_tokens, prompt, prefix_len, model.sliding_window), decode=False)
    return StepPrediction(
        decode_step_ms=decode.step_ms, prefill_step_ms=prefill.step_ms, decode_breakdown=decode.breakdown,
        prefill_breakdown=prefill.breakdown, batch_size=batch, requested_batch_size=batch_size,
        prefill_tokens=int(prefill_tokens), kv_len=kv_len, kv_capacity_tokens=capacity,
        balancedness=rank_load.balancedness if rank_load is not None else 1.0,
        decode_bound=decode.bound, prefill_bound=prefill.bound,
        dropped_fraction=decode.dropped_fraction, limits={"batch_limited_by": limited},
    )
