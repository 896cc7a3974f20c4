"""Bytes one rank holds: weights under a layout, and the KV tokens that fit beside them.

The same arithmetic as ``launch.core.kv_sizing`` (kvcalc), made expert-parallel aware:
kvcalc splits all weights over TP ranks, which for EP144 would count all 256 experts on
every rank; here a rank holds its P / ep routed slots, its 1 / tp share of the dense
weights, and the whole MLA latent (GQA KV heads split over TP).
"""

from __future__ import annotations

import math

from moe.config import ModelConfig
from parallel.costmodel.deployment import Deployment


def weight_bytes_per_rank(cfg: ModelConfig, dep: Deployment) -> int:
    """Weights of one rank: embeddings and lm_head (vocab-parallel over TP, in the activation
    dtype), attention, dense MLPs and shared experts over TP, and P / ep routed slots; the
    norms and DeepSeek-V3's router bias whole on every rank, in the activation dtype (at
    tp = ep = 1 the bytes of ``cfg.num_parameters()``, every parameter counted)."""
    d = cfg.hidden_size
    wb, ab = dep.weight_bytes, dep.act_bytes
    embed = cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2) * ab / dep.tp
    bias = cfg.num_experts if cfg.topk_method == "noaux_tc" else 0
    whole = (d + cfg.num_hidden_layers * 2 * d + len(cfg.moe_layer_ids) * bias) * ab  # norms, router bias
    per_expert = 3 * d * cfg.moe_intermediate_size
    dense = 0.0
    routed = 0.0
    moe_layers = len(cfg.moe_layer_ids)
    for i in range(cfg.num_hidden_layers):
        dense += cfg._attention_parameters()
        if cfg.is_moe_layer(i):
            dense += per_expert * cfg.num_shared_experts + d * cfg.num_experts
        else:
            dense += 3 * d * cfg.intermediate_size
    if moe_layers:
        slots_per_rank = dep.num_slots(cfg.num_experts) // dep.ep
        routed = moe_layers * slots_per_rank * per_expert
    return math.ceil(embed + whole + dense * wb / dep.tp + routed * wb)


def kv_bytes_per_token_per_rank(cfg: ModelConfig, dep: Deployment) -> int:
    """KV bytes per token on one rank: the whole MLA latent, or GQA's KV heads split over TP."""
    per_token = cfg.kv_bytes_per_token(dep.kv_bytes)
    if cfg.attention == "mla":
        return per_token
    heads = max(1, cfg.num_key_value_heads // dep.tp)
    return per_token * heads // cfg.num_key_value_heads


def kv_capacity_tokens(cfg: ModelConfig, dep: Deployment, memory_bytes: int) -> int:
    """Tokens of KV one rank holds: ``dep.kv_capacity_tokens`` when set, else
    (memory x utilization - weights) / KV bytes per token (0 when the weights do not fit)."""
    if dep.kv_capacity_tokens is not None:
        return dep.kv_capacity_tokens
    memory = dep.memory_bytes or memory_bytes
    budget = int(memory * dep.memory_utilization) - weight_bytes_per_rank(cfg, dep)
    return max(0, budget // kv_bytes_per_token_per_rank(cfg, dep))
