"""Per-operator costs (seconds) on one rank: roofline GEMMs, attention, collectives.

Every function is pure arithmetic on ints and a ``Hardware``. Compute time is FLOPs over
the achieved rate, memory time is bytes over the achieved bandwidth, and an operator
costs the larger of the two plus ``kernel_overhead_s`` per kernel (Vidur / InferSim style).

Shape letters: M rows (tokens), N output features, K input features, B sequences,
H local attention heads, S context (KV) length, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe.config import ModelConfig
from parallel.costmodel.hardware import Hardware


@dataclass(frozen=True)
class OpCost:
    """seconds = max(compute_s, memory_s) + overhead_s; flops and bytes it moved."""

    compute_s: float
    memory_s: float
    overhead_s: float
    flops: float
    bytes: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s) + self.overhead_s

    @property
    def is_compute_bound(self) -> bool:
        return self.compute_s >= self.memory_s

    def __add__(self, other: OpCost) -> OpCost:
        return OpCost(self.compute_s + other.compute_s, self.memory_s + other.memory_s,
                      self.overhead_s + other.overhead_s, self.flops + other.flops, self.bytes + other.bytes)


ZERO = OpCost(0.0, 0.0, 0.0, 0.0, 0.0)


def gemm_cost(hw: Hardware, m: float, n: int, k: int, *, dtype: str, weight_bytes: float, act_bytes: float,
              batch: int = 1, kernels: int = 1) -> OpCost:
    """[M, K] x [K, N] (``batch`` such GEMMs with distinct weights, e.g. per head).

    FLOPs = 2 M N K batch; bytes = weights N K batch + activations (M K + M N) batch."""
    if m <= 0:
        return ZERO
    flops = 2.0 * m * n * k * batch
    nbytes = n * k * batch * weight_bytes + (m * k + m * n) * batch * act_bytes
    return OpCost(flops / hw.gemm_rate(dtype, m), nbytes / hw.effective_memory_bandwidth,
                  kernels * hw.kernel_overhead_s, flops, nbytes)


def attention_projection_cost(hw: Hardware, cfg: ModelConfig, tokens: float, tp: int, *, dtype: str,
                              weight_bytes: float, act_bytes: float, decode: bool, kv_tokens: float = 0.0) -> OpCost:
    """Q/KV/O projections of one layer on one TP rank for ``tokens`` new tokens.

    MLA decode uses the absorbed form (per-head W_UK, W_UV on the query/output side); MLA
    prefill expands the latent of every attended token (``kv_tokens``: new + cached) by
    kv_b_proj. The down-projections (q_a, kv_a) are replicated on TP ranks."""
    d, h = cfg.hidden_size, cfg.num_attention_heads // tp
    g = dict(dtype=dtype, weight_bytes=weight_bytes, act_bytes=act_bytes)
    if cfg.attention == "gqa":
        hkv = max(1, cfg.num_key_value_heads // tp)
        return (gemm_cost(hw, tokens, (h + 2 * hkv) * cfg.head_dim, d, **g)
                + gemm_cost(hw, tokens, d, h * cfg.head_dim, **g))
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    lat = cfg.kv_lora_rank
    if cfg.q_lora_rank:
        q = gemm_cost(hw, tokens, cfg.q_lora_rank, d, **g) + gemm_cost(hw, tokens, h * qk, cfg.q_lora_rank, **g)
    else:
        q = gemm_cost(hw, tokens, h * qk, d, **g)
    kv_a = gemm_cost(hw, tokens, lat + cfg.qk_rope_head_dim, d, **g)
    if decode:
        expand = (gemm_cost(hw, tokens, lat, cfg.qk_nope_head_dim, batch=h, **g)
                  + gemm_cost(hw, tokens, cfg.v_head_dim, lat, batch=h, **g))
    else:
        expand = gemm_cost(hw, max(kv_tokens, tokens), h * (cfg.qk_nope_head_dim + cfg.v_head_dim), lat, **g)
    o = gemm_cost(hw, tokens, d, h * cfg.v_head_dim, **g)
    return q + kv_a + expand + o


def attention_core_cost(hw: Hardware, cfg: ModelConfig, tp: int, *, query_tokens: float, attended_pairs: float,
                        kv_read_tokens: float, dtype: str, kv_bytes: float, decode: bool) -> OpCost:
    """softmax(Q K^T) V of one layer on one TP rank.

    attended_pairs: sum over query tokens of the keys each attends (decode: B x S; a
    causal prefill chunk of n tokens after p cached: n p + n (n + 1) / 2).
    kv_read_tokens: cached tokens read from the KV cache (decode: B x S).
    MLA decode (absorbed) attends one shared (kv_lora + rope)-wide key per token and a
    kv_lora-wide value; MLA prefill and GQA attend per-head (qk, v) keys and values."""
    h = cfg.num_attention_heads // tp
    if cfg.attention == "mla":
        width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        if decode:
            qk_dim, v_dim = width, cfg.kv_lora_rank
        else:
            qk_dim, v_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
        kv_width = width
    else:
        qk_dim = v_dim = cfg.head_dim
        kv_width = 2 * max(1, cfg.num_key_value_heads // tp) * cfg.head_dim
    flops = 2.0 * h * (qk_dim + v_dim) * attended_pairs
    nbytes = kv_read_tokens * kv_width * kv_bytes + query_tokens * h * (qk_dim + v_dim) * 2.0
    return OpCost(flops / hw.attention_rate(dtype), nbytes / hw.effective_memory_bandwidth,
                  hw.kernel_overhead_s, flops, nbytes)


def mlp_cost(hw: Hardware, tokens: float, d: int, inter: int, *, dtype: str, weight_bytes: float,
             act_bytes: float) -> OpCost:
    """SwiGLU MLP: gate+up [D -> 2 I] then down [I -> D] on ``tokens`` rows."""
    g = dict(dtype=dtype, weight_bytes=weight_bytes, act_bytes=act_bytes)
    return gemm_cost(hw, tokens, 2 * inter, d, **g) + gemm_cost(hw, tokens, d, inter, **g)


def allreduce_seconds(hw: Hardware, nbytes: float, nranks: int, *, inter_node: bool) -> float:
    """Ring all-reduce of an ``nbytes`` vector over ``nranks``: 2 (n-1)/n x bytes / link +
    2 (n-1) hops of latency, or the measured ``allreduce`` table."""
    if nranks <= 1 or nbytes <= 0:
        return 0.0
    measured = hw.collective_time("allreduce", nranks, nbytes)
    if measured is not None:
        return measured
    bw, lat = hw.link(inter_node)
    return 2 * (nranks - 1) / nranks * nbytes / bw + 2 * (nranks - 1) * lat


def allgather_seconds(hw: Hardware, nbytes: float, nranks: int, *, inter_node: bool) -> float:
    """All-gather whose gathered output is ``nbytes``: (n-1)/n x bytes / link + (n-1) hops."""
    if nranks <= 1 or nbytes <= 0:
        return 0.0
    measured = hw.collective_time("allgather", nranks, nbytes)
    if measured is not None:
        return measured
    bw, lat = hw.link(inter_node)
    return (nranks - 1) / nranks * nbytes / bw + (nranks - 1) * lat


def alltoall_seconds(hw: Hardware, send_bytes: float, recv_bytes: float, nranks: int, *,
                     remote_fraction: float) -> float:
    """One AllToAll-v hop of one rank: ``send_bytes`` out, ``recv_bytes`` in (the larger
    side bounds it). Every row rides NVLink (directly, or forwarded inside the destination
    node); ``remote_fraction`` of the volume also crosses nodes over the rank's NIC, in
    parallel. A measured ``alltoall`` table (size = one rank's send buffer) replaces the
    link model."""
    if nranks <= 1:
        return 0.0
    volume = max(send_bytes, recv_bytes)
    measured = hw.collective_time("alltoall", nranks, volume)
    if measured is not None:
        return measured
    intra_bw, intra_lat = hw.link(False)
    t = volume / intra_bw + intra_lat
    if remote_fraction > 0:
        inter_bw, inter_lat = hw.link(True)
        t = max(t, remote_fraction * volume / inter_bw + inter_lat)
    return t
