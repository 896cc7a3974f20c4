"""Bytes one rank holds: weights under a layout, and the KV tokens that fit beside them.

A rank holds what this runtime's sharding gives it (``moe.model.MoEModel.shard_for_tp``, the
experts' placement): its 1 / tp share of attention and dense MLPs, its P / ep routed expert
slots (every routed expert when ep = 1), everything else (embeddings, lm_head, shared experts,
routers, norms) whole, and the whole MLA latent (GQA KV heads split over TP).
``launch.hardware.compute_layout_kv_sizing`` turns this into the KV capacity that kvcalc,
simulate and the engine report.
"""

from __future__ import annotations

import math

from moe.config import ModelConfig
from parallel.costmodel.deployment import Deployment


def weight_bytes_per_rank(cfg: ModelConfig, dep: Deployment) -> int:
    """Weights of one rank, as this runtime shards them: attention's heads and dense MLPs over TP
    (``ModelConfig._attention_parameters(tp)``: MLA's latent projections stay whole) and P / ep
    routed slots, in ``dep.weight_dtype``; shared experts whole in the weight dtype; embeddings,
    lm_head and norms whole in the activation dtype; routers and DeepSeek-V3's router bias whole in
    float32 (``moe.router``). At tp = ep = 1 in float32: the bytes of ``cfg.num_parameters()``."""
    d = cfg.hidden_size
    wb, ab = dep.weight_bytes, dep.act_bytes
    moe_layers = len(cfg.moe_layer_ids)
    embed = cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2)
    small = embed + d + cfg.num_hidden_layers * 2 * d  # embeddings, lm_head, norms: activation dtype
    bias = cfg.num_experts if cfg.topk_method == "noaux_tc" else 0
    routers = moe_layers * (d * cfg.num_experts + bias)  # float32
    per_expert = 3 * d * cfg.moe_intermediate_size
    held = 0.0  # weight dtype: attention and dense MLPs (this rank's share), shared and routed experts
    for i in range(cfg.num_hidden_layers):
        held += cfg._attention_parameters(dep.tp)
        if not cfg.is_moe_layer(i):
            held += 3 * d * cfg.intermediate_size / dep.tp
    held += moe_layers * per_expert * cfg.num_shared_experts
    if moe_layers:
        held += moe_layers * (dep.num_slots(cfg.num_experts) // dep.ep) * per_expert
    return math.ceil(small * ab + routers * 4 + held * wb)


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
