"""Multi-head latent attention (DeepSeek V2/V3) over a latent paged cache.

Shape legend: T tokens, D hidden, H heads (local to the TP rank), C kv_lora_rank,
R qk_rope_head_dim, Nn qk_nope_head_dim, Vd v_head_dim, L gathered context length.

The cache holds only ``[c_kv | k_pe]`` ([C + R] per token). Prefill chunks use the naive
path (expand c_kv with kv_b_proj to per-head keys/values); decode uses the absorbed path:
W_UK [H, Nn, C] folds into the query (q_lat = q_nope W_UK), attention runs as MQA over the
latent, and W_UV [H, Vd, C] maps the C-wide result back per head. On CPU a step of decode
rows only runs the whole attention (projections, latent norm, rope, cache write, absorbed
products, paged attention, o_proj) as one op, ``kernels.mla_decode_attention``, bit-equal to
running those ops one by one.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from moe import kernels
from moe.config import ModelConfig
from moe.kv_cache import AttentionMetadata, KVLayerView
from moe.layers.linear import Linear, cached_pack, kernel_applies, kernel_weights
from moe.layers.mlp import shard_linear_
from moe.layers.norm import RMSNorm
from moe.layers.paged import paged_attention, sdpa
from moe.layers.rope import apply_rotary
from moe.plan_watch import WatchedModule

# (x [B, D], cos, sin, meta, view) -> [B, D]: one layer's whole decode attention with its weights bound
DecodeAttentionOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, KVLayerView], torch.Tensor]

# transformers (and DeepSeek's reference code) build q_a_layernorm / kv_a_layernorm with
# the default eps, not config.rms_norm_eps
_LATENT_NORM_EPS = 1e-6


class MLAAttention(WatchedModule):
    """x: [T, D] -> o_proj output [T, D] (this TP rank's partial sum; all-reduce outside)."""

    # what fused_decode_op's answer and bound arguments read besides x, the cache and the weights
    DECISION_ATTRS = ("use_fused_decode", "use_fused_rope_cache", "use_paged_kernel", "absorb_decode", "num_heads",
                      "q_lora_rank", "nope", "v_dim", "interleave", "scale")

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        d, h = config.hidden_size, config.num_attention_heads
        self.num_heads = h
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scale = config.softmax_scale
        self.interleave = config.rope_interleave
        self.absorb_decode = True
        # decode attention by the CPU kernel straight from the paged cache (False: gather + sdpa,
        # the reference in tests)
        self.use_paged_kernel = True
        # prefill rows by the CPU kernel: every prefill sequence's cached latents expanded by
        # kv_b_proj in one GEMM, then causal attention in one call (False: per sequence, gather +
        # expand + masked sdpa, the reference in tests)
        self.use_prefill_kernel = True
        # rope, kv_a_layernorm and the cache write as one CPU op (False: the PyTorch ops)
        self.use_fused_rope_cache = True
        # a step of decode rows only: the whole attention as one CPU op (False: op by op)
        self.use_fused_decode = True
        bias = config.attention_bias
        qk = self.nope + self.rope
        if config.q_lora_rank is None:
            self.q_proj = Linear(d, h * qk, bias=False, dtype=dtype)
        else:
            self.q_a_proj = Linear(d, config.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, _LATENT_NORM_EPS, dtype)
            self.q_b_proj = Linear(config.q_lora_rank, h * qk, bias=False, dtype=dtype)
        self.q_lora_rank = config.q_lora_rank
        self.kv_a_proj_with_mqa = Linear(d, self.kv_lora_rank + self.rope, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS, dtype)
        self.kv_b_proj = Linear(self.kv_lora_rank, h * (self.nope + self.v_dim), bias=False, dtype=dtype)
        self.o_proj = Linear(h * self.v_dim, d, bias=bias, dtype=dtype)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, cache: KVLayerView
    ) -> torch.Tensor:
        """x: [T, D]; cos, sin: [T, R/2]. Writes [c_kv | k_pe] to ``cache``. Returns [T, D]."""
        t = x.shape[0]
        if self.use_fused_decode and t == len(meta.query_lens_list) and t:  # every row a decode row
            fused = self.fused_decode_op(x, cache)
            if fused is not None:
                return fused(x, cos, sin, meta, cache)
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.nope + self.rope)
        latent = self.kv_a_proj_with_mqa(x)  # [T, C + R]
        if self._fused_rope_cache_applies(q, latent, cache):  # rope, latent norm and cache write in one op
            q = kernels.mla_rope_cache(q, latent, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, cos, sin,
                                       self.interleave, cache.pool, meta.slot_mapping)
        else:
            q = torch.cat((q[..., : self.nope], apply_rotary(q[..., self.nope :], cos, sin, self.interleave)), dim=-1)
            c_kv = self.kv_a_layernorm(latent[:, : self.kv_lora_rank])
            k_pe = apply_rotary(latent[:, None, self.kv_lora_rank :], cos, sin, self.interleave)[:, 0]
            cache.write(meta.slot_mapping, torch.cat((c_kv, k_pe), dim=-1))  # [T, C + R]
        decode_fn = self._attend_absorbed if self.absorb_decode else self._attend_naive
        paged_fn = self._attend_paged if self._paged_decode_applies(q, cache) else None
        prefill_fn = self._prefill_paged if self._prefill_kernel_applies(q) else None
        out = paged_attention(q, meta, cache, self.v_dim, decode_fn, self._attend_naive, decode_paged_fn=paged_fn,
                              prefill_paged_fn=prefill_fn)
        return self.o_proj(out.reshape(t, self.num_heads * self.v_dim))

    def _attend_naive(self, q: torch.Tensor, latent: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q: [B, H, Lq, Nn + R]; latent: [B, L, C + R]; mask: [B, 1, Lq, L]. Returns [B, H, Lq, Vd]."""
        b, length = latent.shape[:2]
        latent = latent.to(q.dtype)
        kv = self.kv_b_proj(latent[..., : self.kv_lora_rank]).view(b, length, self.num_heads, -1)
        k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
        k_pe = latent[:, :, None, self.kv_lora_rank :].expand(b, length, self.num_heads, self.rope)
        k = torch.cat((k_nope, k_pe), dim=-1)
        return sdpa(q, k.transpose(1, 2), v.transpose(1, 2), mask, self.scale)

    def _prefill_paged(self, q: torch.Tensor, view: KVLayerView, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, query_starts: torch.Tensor) -> torch.Tensor:
        """``_attend_naive`` for the rows q [Tp, H, Nn + R] of every prefill sequence at once
        (``paged.PagedPrefillFn``): their cached latents gathered block by block into one
        [Nb * S, C + R] run, expanded by kv_b_proj in one GEMM into per-head k_nope and values, then
        the CPU kernel's causal attention over those blocks, each key [k_nope | k_pe] with the shared
        k_pe read once (no per-head copy). Returns [Tp, H, Vd]."""
        size = view.pool.shape[1]
        counts = [-(-int(n) // size) for n in context_lens.tolist()]  # blocks per sequence
        nb = max(counts)
        keep = torch.arange(nb, device=q.device)[None, :] < torch.tensor(counts, device=q.device)[:, None]
        latent = view.gather(block_tables[:, :nb][keep][None])[0].to(q.dtype)  # [Nb * S, C + R]
        h, c = self.num_heads, self.kv_lora_rank
        kv = self.kv_b_proj(latent[:, :c]).view(-1, size, h, self.nope + self.v_dim)  # [Nb, S, H, Nn + Vd]
        k_pe = latent[:, c:].reshape(-1, size, self.rope)  # [Nb, S, R]: every head's rope key, not copied per head
        firsts = torch.tensor([0, *itertools.accumulate(counts)][:-1], device=q.device)
        tables = torch.where(keep, firsts[:, None] + torch.arange(nb, device=q.device)[None, :], 0)
        return kernels.mla_prefill(q, kv, tables, context_lens, query_starts, self.v_dim, self.scale, k_pe=k_pe)

    def _prefill_kernel_applies(self, q: torch.Tensor) -> bool:
        """Whether ``_prefill_paged`` can serve this step's prefill rows q [T, H, Nn + R]: CPU, the
        kernel built, q and the kv_b_proj weight in one dtype (any cache dtype: the gathered latents
        are converted), no autograd."""
        return self.use_prefill_kernel and kernels.cpu_op_applies(q, self.kv_b_proj.weight)

    def _attend_absorbed(self, q: torch.Tensor, latent: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Same contract as ``_attend_naive``, computed in the latent space."""
        packed = self._absorbed_packed(q)
        q_full = self._absorb_query(q, packed)  # [B, H, Lq, C + R]
        latent = latent.to(q.dtype)[:, None]  # [B, 1, L, C + R]: one shared key head
        # values = the whole contiguous latent row, rope columns dropped after: the batched GEMM
        # against a strided [..., :C] view is ~2x slower, the R extra columns cost R/C more FLOPs
        o_lat = sdpa(q_full, latent, latent, mask, self.scale)[..., : self.kv_lora_rank]  # [B, H, Lq, C]
        return self._expand_values(o_lat, packed)

    def _attend_paged(self, q: torch.Tensor, view: KVLayerView, block_tables: torch.Tensor,
                      context_lens: torch.Tensor) -> torch.Tensor:
        """Absorbed decode read straight from the paged cache by the CPU kernel (no gathered copy).
        q: [B, H, Nn + R]; block_tables: [B, nb]; context_lens: [B]. Returns [B, H, Vd]."""
        q4 = q[:, :, None]
        packed = self._absorbed_packed(q4)
        q_full = self._absorb_query(q4, packed)[:, :, 0]  # [B, H, C + R]
        o_lat = kernels.mla_decode(q_full.contiguous(), view.pool, block_tables, context_lens, self.kv_lora_rank,
                                   self.scale, view.kernel_scale())  # [B, H, C]
        return self._expand_values(o_lat[:, :, None], packed)[:, :, 0]

    def _fused_decode_weights(self, x: torch.Tensor, view: KVLayerView) -> tuple[torch.Tensor | None, ...] | None:
        """The packed weights of ``kernels.mla_decode_attention`` when it can stand in for this
        forward on decode rows x [B, D], else None: exactly when every op of the op-by-op path
        would take its CPU kernel (fused rope / cache write, paged decode, the absorbed path and
        every projection on the packed linear kernel at B rows)."""
        if not (self.use_fused_rope_cache and self.use_paged_kernel and self.absorb_decode):
            return None
        # kernel_applies / cpu_op_applies for every op, with x's checks made once (this runs every layer
        # of every decode step)
        mods = self._modules  # submodules without nn.Module.__getattr__
        dtype = x.dtype
        if not (kernels.cpu_op_applies(x, mods["kv_a_layernorm"].weight)
                and kernels.paged_cache_applies(x, view.pool) and view.scale_settled):
            return None
        if kernels.prefers_library_gemm(dtype, x.shape[0]):
            return None
        weights = kernel_weights(self._linears(), dtype)
        if weights is None:
            return None
        if not self._absorbed_packs(dtype):
            return None
        if self.q_lora_rank is not None:
            norm = mods["q_a_layernorm"]
            if not (norm.use_kernel and kernels.cpu_op_applies(x, norm.weight)):
                return None

        def packed(name: str) -> torch.Tensor:  # a projection's own packed copy, shared with the op-by-op path
            return mods[name].packed().wp

        def pack(*weights: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            # kv_b_proj enters only as the absorbed W_UK / W_UV, never as a plain linear
            lora = self.q_lora_rank is not None
            wuk, wuv = self._absorbed_packed_weights()
            return (packed("q_a_proj") if lora else None, packed("q_b_proj" if lora else "q_proj"),
                    packed("kv_a_proj_with_mqa"), wuk.wp, wuv.wp, packed("o_proj"))

        return cached_pack(self, "_fused_decode", weights, pack)

    def fused_decode_op(self, x: torch.Tensor, view: KVLayerView) -> DecodeAttentionOp | None:
        """``kernels.mla_decode_attention`` with this layer's weights bound, when it can stand in for
        this forward on decode rows x [B, D] (``_fused_decode_weights``), else None. The op takes
        ``(x [B, D], cos, sin, meta, view)`` and returns [B, D]; its weights hold until one of them
        or a switch changes (``moe.decode_plan`` keeps it over steps on that condition)."""
        if not self.use_fused_decode:
            return None
        weights = self._fused_decode_weights(x, view)
        if weights is None:
            return None
        mods = self._modules
        lora = self.q_lora_rank is not None
        q_lin = mods["q_b_proj"] if lora else mods["q_proj"]
        q_a = mods["q_a_proj"] if lora else None
        kv_norm, o_proj = mods["kv_a_layernorm"], mods["o_proj"]
        biases = (q_a.bias if q_a is not None else None, q_lin.bias, mods["kv_a_proj_with_mqa"].bias, o_proj.bias)
        q_norm = mods["q_a_layernorm"] if lora else None
        norms = (q_norm.weight if q_norm is not None else None, kv_norm.weight)
        eps = (q_norm.eps if q_norm is not None else 0.0, kv_norm.eps)
        dims = (self.num_heads, self.nope, self.v_dim, self.q_lora_rank or 0, q_lin.weight.shape[0],
                o_proj.weight.shape[0])
        run = kernels.mla_decode_attention_op(weights, biases, norms, eps, dims, self.interleave, self.scale)

        def attend(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                   view: KVLayerView) -> torch.Tensor:
            return run(x, cos, sin, view.pool, meta.slot_mapping, meta.block_tables, meta.context_lens,
                       view.kernel_scale())

        return attend

    def _linears(self) -> list[Linear]:
        """The projections in ``kernels.mla_decode_attention``'s order: [q_a_proj,] q (q_b_proj or
        q_proj), kv_a_proj_with_mqa, kv_b_proj (the absorbed W_UK / W_UV), o_proj."""
        mods = self._modules
        q = [mods["q_proj"]] if self.q_lora_rank is None else [mods["q_a_proj"], mods["q_b_proj"]]
        return [*q, mods["kv_a_proj_with_mqa"], mods["kv_b_proj"], mods["o_proj"]]

    def _fused_rope_cache_applies(self, q: torch.Tensor, latent: torch.Tensor, view: KVLayerView) -> bool:
        """Whether ``kernels.mla_rope_cache`` can stand in for the rope / norm / cache-write ops: CPU,
        q, latent, the norm weight and the cache in one dtype (so not an fp8 cache), no autograd, built."""
        return self.use_fused_rope_cache and kernels.cpu_op_applies(q, latent, self.kv_a_layernorm.weight, view.pool)

    def _paged_decode_applies(self, q: torch.Tensor, view: KVLayerView) -> bool:
        """Whether ``_attend_paged`` can serve this step's decode rows q [T, H, Nn + R]: CPU, the
        kernel built, the cache stored in q's dtype or fp8, no autograd, the absorbed path on."""
        return (self.absorb_decode and self.use_paged_kernel and kernels.paged_cache_applies(q, view.pool)
                and not kernels.needs_autograd(self.kv_b_proj.weight))

    def _absorb_query(self, q: torch.Tensor, packed: tuple[kernels.PackedLinear, ...] | None) -> torch.Tensor:
        """q: [B, H, Lq, Nn + R] -> [B, H, Lq, C + R]: q_nope W_UK, then the rope part unchanged."""
        if packed is None:
            w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
            q_lat = torch.einsum("bhqn,hnc->bhqc", q[..., : self.nope], w[:, : self.nope])  # W_UK [H, Nn, C]
        else:  # per-head products on the packed linear kernel: x [H, B * Lq, K] @ W[h]^T
            b, h, lq = q.shape[:3]
            q_nope = q[..., : self.nope].permute(1, 0, 2, 3).reshape(h, b * lq, self.nope)
            q_lat = kernels.linear_forward(q_nope, packed[0]).view(h, b, lq, -1).permute(1, 0, 2, 3)
        return torch.cat((q_lat, q[..., self.nope :]), dim=-1)

    def _expand_values(self, o_lat: torch.Tensor, packed: tuple[kernels.PackedLinear, ...] | None) -> torch.Tensor:
        """o_lat: [B, H, Lq, C] -> [B, H, Lq, Vd] through W_UV [H, Vd, C]."""
        if packed is None:
            w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
            return torch.einsum("bhqc,hvc->bhqv", o_lat, w[:, self.nope :])
        b, h, lq = o_lat.shape[:3]
        o_rows = o_lat.permute(1, 0, 2, 3).reshape(h, b * lq, self.kv_lora_rank)
        return kernels.linear_forward(o_rows, packed[1]).view(h, b, lq, self.v_dim).permute(1, 0, 2, 3)

    def _absorbed_packed(self, q: torch.Tensor) -> tuple[kernels.PackedLinear, kernels.PackedLinear] | None:
        """W_UK^T [H, C, Nn] and W_UV [H, Vd, C] packed for the linear kernel (remade when kv_b_proj's
        weight changes), or None when the kernel should not run for q [B, H, Lq, Nn + R]."""
        weight = self.kv_b_proj.weight
        if not self.kv_b_proj.use_kernel or not kernel_applies(q, weight, q.shape[0] * q.shape[2]):
            return None
        if not self._absorbed_packs(weight.dtype):
            return None
        return self._absorbed_packed_weights()

    def _absorbed_packs(self, dtype: torch.dtype) -> bool:
        """Whether W_UK^T [H, C, Nn] packs for the linear kernel in ``dtype``: its K is Nn, and bf16
        blocks hold k pairs (``kernels.can_pack_linear``), so bf16 needs Nn even."""
        return dtype != torch.bfloat16 or self.nope % 2 == 0

    def _absorbed_packed_weights(self) -> tuple[kernels.PackedLinear, kernels.PackedLinear]:
        """W_UK^T [H, C, Nn] and W_UV [H, Vd, C] packed (cached; remade when kv_b_proj's weight changes)."""

        def pack(w: torch.Tensor) -> tuple[kernels.PackedLinear, kernels.PackedLinear]:
            w = w.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
            return kernels.pack_linear(w[:, : self.nope].transpose(1, 2)), kernels.pack_linear(w[:, self.nope :])

        return cached_pack(self, "_absorbed", (self.kv_b_proj.weight,), pack)

    def shard_for_tp(self, tp_rank: int, tp_size: int) -> None:
        """Keep heads [r*H/tp, (r+1)*H/tp); the latent projections (and cache) stay replicated."""
        if self.num_heads % tp_size:
            raise ValueError(f"num_heads {self.num_heads} is not divisible by tp_size {tp_size}")
        h = self.num_heads // tp_size

        def rows(width: int) -> slice:
            return slice(tp_rank * h * width, (tp_rank + 1) * h * width)

        q_lin = self.q_proj if self.q_lora_rank is None else self.q_b_proj
        shard_linear_(q_lin, out_slice=rows(self.nope + self.rope))
        shard_linear_(self.kv_b_proj, out_slice=rows(self.nope + self.v_dim))
        shard_linear_(self.o_proj, in_slice=rows(self.v_dim), keep_bias=tp_rank == 0)
        self.num_heads = h
