"""Grouped-query attention (Mixtral, Qwen3-MoE with per-head q/k RMSNorm) over the paged cache.

Shape legend: T tokens, D hidden, H query heads, Hkv key/value heads, hd head_dim
(local to this TP rank after ``shard_for_tp``).
"""

from __future__ import annotations

import torch

from moe import kernels
from moe.config import ModelConfig
from moe.kv_cache import AttentionMetadata, KVLayerView
from moe.layers.linear import Linear, kernel_weights
from moe.layers.mla import DecodeAttentionOp
from moe.layers.mlp import shard_linear_
from moe.layers.norm import RMSNorm
from moe.layers.paged import paged_attention, sdpa, window_sees_every_key
from moe.layers.rope import apply_rotary
from moe.plan_watch import WatchedModule


class GQAAttention(WatchedModule):
    """x: [T, D] -> o_proj output [T, D] (this TP rank's partial sum; all-reduce outside).

    ``layer_id`` selects the layer's attention window (``config.layer_sliding_window``).
    """

    # what fused_decode_op's answer and bound arguments read besides x, the cache and the weights
    DECISION_ATTRS = ("use_fused_decode", "use_paged_kernel", "num_heads", "num_kv_heads", "head_dim", "interleave",
                      "scale", "sliding_window")

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, layer_id: int = 0) -> None:
        super().__init__()
        self.sliding_window = config.layer_sliding_window(layer_id)
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.scale = config.softmax_scale
        self.interleave = config.rope_interleave
        bias = config.attention_bias
        self.q_proj = Linear(d, self.num_heads * hd, bias=bias, dtype=dtype)
        self.k_proj = Linear(d, self.num_kv_heads * hd, bias=bias, dtype=dtype)
        self.v_proj = Linear(d, self.num_kv_heads * hd, bias=bias, dtype=dtype)
        self.o_proj = Linear(self.num_heads * hd, d, bias=bias, dtype=dtype)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        for p in self.parameters():
            p.requires_grad_(False)
        # decode attention by the CPU kernel straight from the paged cache (False: gather + sdpa,
        # the reference in tests)
        self.use_paged_kernel = True
        # prefill rows by the CPU kernel straight from the paged cache, every sequence in one call
        # (False: per sequence, gather + masked sdpa, the reference in tests)
        self.use_prefill_kernel = True
        # a step of decode rows only: the whole attention as one CPU op (False: op by op)
        self.use_fused_decode = True

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, cache: KVLayerView
    ) -> torch.Tensor:
        """x: [T, D]; cos, sin: [T, hd/2]. Writes this step's k/v to ``cache``. Returns [T, D]."""
        t = x.shape[0]
        if self.use_fused_decode and t == len(meta.query_lens_list) and t:  # every row a decode row
            fused = self.fused_decode_op(x, cache)
            if fused is not None:
                return fused(x, cos, sin, meta, cache)
        return self._forward_ops(x, cos, sin, meta, cache)

    def _forward_ops(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                     cache: KVLayerView) -> torch.Tensor:
        """``forward`` op by op (x: [T, D] -> [T, D]), whatever the rows are."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, cos, sin, self.interleave)
        k = apply_rotary(k, cos, sin, self.interleave)
        cache.write(meta.slot_mapping, torch.stack((k, v), dim=1))  # [T, 2, Hkv, hd]
        paged_fn = self._attend_paged if self._paged_decode_applies(q, cache) else None
        prefill_fn = self._prefill_paged if self._prefill_kernel_applies(q, cache) else None
        out = paged_attention(q, meta, cache, self.head_dim, self._attend, self._attend,
                              sliding_window=self.sliding_window, decode_paged_fn=paged_fn,
                              prefill_paged_fn=prefill_fn)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q: [B, H, Lq, hd]; kv: [B, L, 2, Hkv, hd]; mask: [B, 1, Lq, L]. Returns [B, H, Lq, hd]."""
        k = kv[:, :, 0].transpose(1, 2)
        v = kv[:, :, 1].transpose(1, 2)
        return sdpa(q, k.to(q.dtype), v.to(q.dtype), mask, self.scale)

    def _attend_paged(self, q: torch.Tensor, view: KVLayerView, block_tables: torch.Tensor,
                      context_lens: torch.Tensor) -> torch.Tensor:
        """Decode rows read straight from the paged cache by the CPU kernel. q: [B, H, hd];
        block_tables: [B, nb]; context_lens: [B]. Returns [B, H, hd]."""
        return kernels.gqa_decode(q.contiguous(), view.pool, block_tables, context_lens, self.scale,
                                  view.kernel_scale())

    def _prefill_paged(self, q: torch.Tensor, view: KVLayerView, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, query_starts: torch.Tensor) -> torch.Tensor:
        """The prefill sequences' rows q [Tp, H, hd] (``paged.PagedPrefillFn``) read straight from
        the paged cache by the CPU kernel, the sliding window applied there. Returns [Tp, H, hd]."""
        return kernels.gqa_prefill(q, view.pool, block_tables, context_lens, query_starts, self.scale,
                                   self.sliding_window, view.kernel_scale())

    def _prefill_kernel_applies(self, q: torch.Tensor, view: KVLayerView) -> bool:
        """Whether ``_prefill_paged`` can serve this step's prefill rows q [T, H, hd]: CPU, the
        kernel built, the cache stored in q's dtype or fp8, no autograd."""
        return self.use_prefill_kernel and kernels.paged_cache_applies(q, view.pool)

    def _paged_decode_applies(self, q: torch.Tensor, view: KVLayerView) -> bool:
        """Whether ``_attend_paged`` can serve this step's decode rows q [T, H, hd]: CPU, the kernel
        built, the cache stored in q's dtype or fp8, no autograd. (``paged_attention`` hands a
        sliding-window layer's decode rows to the kernel only when every context fits in the window.)"""
        return self.use_paged_kernel and kernels.paged_cache_applies(q, view.pool)

    def fused_decode_op(self, x: torch.Tensor, view: KVLayerView) -> DecodeAttentionOp | None:
        """``kernels.gqa_decode_attention_op`` with this layer's weights bound, when it can stand in
        for this forward on decode rows x [B, D], else None: exactly when every op of the op-by-op
        path would take its CPU kernel (every projection on the packed linear kernel at B rows, the
        per-head norms on theirs, the paged decode kernel, a cache in x's dtype or an fp8 one whose
        scale is settled) and the head dim is even. With a sliding window the op serves the steps whose contexts all fit in it (each query
        then sees every key, as the op does); a step with a longer one runs op by op. The op takes
        ``(x [B, D], cos, sin, meta, view)`` and returns [B, D]; its weights hold until one of them
        or a switch changes (``moe.decode_plan`` keeps it over steps on that condition)."""
        if not (self.use_fused_decode and self.use_paged_kernel):
            return None
        if self.head_dim % 2:
            return None
        mods = self._modules  # submodules without nn.Module.__getattr__
        linears = [mods["q_proj"], mods["k_proj"], mods["v_proj"], mods["o_proj"]]
        dtype = x.dtype
        if not (kernels.paged_cache_applies(x, view.pool) and view.scale_settled):
            return None
        if kernels.prefers_library_gemm(dtype, x.shape[0]):
            return None
        if kernel_weights(linears, dtype) is None:
            return None
        norms = None
        if self.q_norm is not None:
            q_norm, k_norm = mods["q_norm"], mods["k_norm"]
            if not (q_norm.use_kernel and k_norm.use_kernel and kernels.cpu_op_applies(x, q_norm.weight, k_norm.weight)):
                return None
            norms, eps = (q_norm.weight, k_norm.weight), (q_norm.eps, k_norm.eps)
        else:
            eps = (0.0, 0.0)
        packed = tuple(lin.packed().wp for lin in linears)
        biases = tuple(lin.bias for lin in linears)
        dims = (self.num_heads, self.num_kv_heads, self.head_dim, linears[3].weight.shape[0])
        run = kernels.gqa_decode_attention_op(packed, biases, norms, eps, dims, self.interleave, self.scale)
        window = self.sliding_window

        def attend(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                   view: KVLayerView) -> torch.Tensor:
            if not window_sees_every_key(meta.context_lens_list, window):  # the op sees every key
                return self._forward_ops(x, cos, sin, meta, view)
            return run(x, cos, sin, view.pool, meta.slot_mapping, meta.block_tables, meta.context_lens,
                       view.kernel_scale())

        return attend

    def shard_for_tp(self, tp_rank: int, tp_size: int) -> None:
        """Keep heads [r*H/tp, (r+1)*H/tp) and kv heads likewise (after loading full weights). With
        more ranks than kv heads (tp a multiple of them, vLLM's rule) each rank keeps the one kv head
        its query heads share: a kv head is replicated on tp / H_kv ranks."""
        h, h_kv = self.num_heads, self.num_kv_heads
        if h % tp_size or (h_kv % tp_size and tp_size % h_kv):
            raise ValueError(f"tp_size {tp_size} must divide num_heads {h} and divide or be a multiple of "
                             f"num_kv_heads {h_kv}")
        hq, hd = h // tp_size, self.head_dim
        hk = max(1, h_kv // tp_size)
        first_kv = tp_rank * h_kv // tp_size  # the kv head of the rank's first query head
        q_rows = slice(tp_rank * hq * hd, (tp_rank + 1) * hq * hd)
        kv_rows = slice(first_kv * hd, (first_kv + hk) * hd)
        shard_linear_(self.q_proj, out_slice=q_rows)
        shard_linear_(self.k_proj, out_slice=kv_rows)
        shard_linear_(self.v_proj, out_slice=kv_rows)
        shard_linear_(self.o_proj, in_slice=q_rows, keep_bias=tp_rank == 0)
        self.num_heads, self.num_kv_heads = hq, hk
