"""Fused routed-expert CPU kernel (C++ extension) and the packed weight layout it reads.

Shape legend: P local expert slots, D hidden, I expert intermediate, N routed rows.

``mla_decode`` is MLA's absorbed decode attention read straight from the paged latent cache
(no gathered copy, all of a sequence's heads per pass over its blocks); ``gqa_decode`` the same
for a grouped-query cache.

``rms_norm`` is RMSNorm in one op (the PyTorch expression is eight); ``add_rms_norm`` is the residual
add before it and the norm in one op (decode steps: ``moe.decode_plan``).

``mla_decode_attention`` is MLA's whole attention for a step of decode rows (projections, latent
norm, rope, cache write, absorbed products, ``mla_decode``, o_proj) in one op: the same C++ calls
in the same order as the op-by-op path, without a Python round trip between them. ``moe_ffn`` does
the same for the MoE feed-forward of a rank that hosts every slot (router, replica choice, slot load,
routed and shared experts).

``linear_forward`` runs a plain (optionally batched) linear on weights packed the same way
by ``pack_linear`` (``wp [G, C/16, K, 16]``): the attention projections, lm_head and MLA's
per-head absorbed products, which PyTorch runs at about 1 GFLOP/s in bf16 on CPUs without
native bf16 GEMMs.

``experts_forward`` computes what ``moe.experts.grouped_expert_forward`` computes (the
SwiGLU experts over rows grouped by slot, each row scaled by its routing weight), from
weights packed once by ``pack_experts``:

- ``w13p [P, I/8, D, 16]``: column blocks of 16 output channels, 8 gate channels then the
  same 8 up channels, the reduction dimension D outermost inside a block, so one register
  tile produces both halves of SwiGLU and streams its block contiguously;
- ``w2p [P, D/16, I, 16]``: the down projection in the same block order;
- an I that is not a multiple of 8 (for bf16 on AMX: of 32) is packed zero-padded to one
  (``inter_multiple``): the padded channels' SiLU(0) * 0 adds nothing, so any I runs the kernel,
  and on AMX the down projection's reduction stays on the tiles (D must be a multiple of 16);
- bf16 blocks hold k pairs: memory order ``[K/2, 16, 2]`` inside a ``[K, 16]`` block (K even),
  the order AVX512-BF16's ``vdpbf16ps`` reads; ``unpack_blocks`` inverts any block order;
- int8 (``quantization="int8"``): the same layout in int8 with one fp32 scale per output
  channel (``s13 [P, I/8, 16]``, ``s2 [P, D/16, 16]``, absmax / 127, round to nearest).

The extension is compiled with ``torch.utils.cpp_extension`` on first use (or ahead of time
with ``python -m launch build-kernels``) into a cache directory keyed by the source hash,
torch version, Python version and machine; ``MOE_KERNEL_CACHE`` overrides the directory
and ``MOE_CPU_KERNEL=0`` turns the kernel off (``MOE_KERNEL_ISA=avx512`` etc. picks an instruction
set for the process, for A/B runs). The instruction set (AMX, AVX512-BF16, AVX-512, AVX2+FMA or
baseline) is chosen from cpuid when the library loads: one build runs on any x86-64 CPU. AMX
(``amx``: AMX-TILE and AMX-BF16, and Linux granting the process the tile state) runs the AVX-512
kernels with the bf16 x bf16 products of the experts and linears on tdpbf16ps tiles
(``amx_body.h``): the packed bf16 block is the tile's weight operand as it lies, and bf16
activations round between the projections as on the dot tiles; weights whose K is not a multiple of
32 run the vdpbf16ps tiles instead. AVX512-BF16 is chosen only where a ~1 ms probe finds its dot
product at least as fast as the fp32 FMA (``bf16_dot_rate``: ~2x on AMD Zen 4/5, ~0.5x on Intel
cores without AMX, whose oneDNN bf16 GEMMs are then slower than fp32 ones too); the first process
on a CPU probes and keeps the rate beside the build, so every process of the machine picks the same
tiles. On it, bf16 rows against bf16 weights run on the dot product (``dot_body.h``): the SwiGLU
activations between the two projections are then rounded to bf16, as the bf16 PyTorch path rounds
them; elsewhere rows widen to fp32 and stay fp32 inside the op. int8 experts meeting bf16 rows take
the dot tiles too (AMX or AVX512-BF16) in calls of at least 16 rows per busy expert (prefill sizes):
each work item's blocks are dequantized once per call into a thread's bf16 scratch, the values
``dequantize_int8`` gives in bf16, so those calls compute what the bf16 path computes on the
dequantized weights, bit for bit; smaller calls (decode) widen both to fp32 on the FMA tiles, which
read half the bytes for the few rows each expert gets.
Without a compiler the model falls back to the PyTorch path after one log line.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe import host_memory
from moe.cpu_gemm import has_amx_bf16, has_fast_bf16_gemm

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = ("experts_cpu.cpp", "experts_body.h", "exp_body.h", "dot_body.h", "amx_body.h", "fp8_body.h",
           "attention_body.h", "norm_body.h")
QUANTIZATIONS = ("int8",)
ISAS = ("generic", "avx2", "avx512", "avx512bf16", "amx")  # slowest first
# names one of ISAS for the whole process (A/B runs of one build); unset or "auto": the fastest here
ISA_ENV = "MOE_KERNEL_ISA"
BLOCK = 16  # output channels per packed column block
# Mean rows per non-empty expert from which a dtype with a fast library GEMM on this CPU (fp32;
# bf16 with AVX512-BF16 or AMX) runs PyTorch's GEMMs instead of the kernel. Measured on Zen 3
# in fp32: the kernel 1.2-1.6x faster up to ~400 rows per expert, MKL's sgemm 1.1x at 1024.
LIBRARY_GEMM_MIN_ROWS = 512


# "no tensor" for the ops' optional arguments (bias, row weights): one shared empty tensor instead
# of a new one per call (the ops only read it)
_NONE = torch.empty(0, dtype=torch.float32)
_NO_COUNT = torch.zeros(0, dtype=torch.int64)  # moe_ffn's dropped count without a capacity: never written


@dataclass(frozen=True)
class PackedExperts:
    """Routed-expert weights in the kernel's layout (see the module docstring).

    w13p: [P, I/8, D, 16]; w2p: [P, D/16, I, 16] (float32, bfloat16 or int8), I here the
    weights' intermediate size padded to a multiple of 8, or of 32 on AMX (``inter_multiple``).
    s13: [P, I/8, 16] float32 and s2: [P, D/16, 16] float32 for int8, else empty tensors.
    """

    w13p: torch.Tensor
    w2p: torch.Tensor
    s13: torch.Tensor
    s2: torch.Tensor

    @property
    def quantized(self) -> bool:
        return self.w13p.dtype == torch.int8

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w13p, self.w2p, self.s13, self.s2))


def can_pack(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether w13 [P, 2I, D] / w2 [P, D, I] fit the kernel: CPU, fp32/bf16, D % 16 == 0 (any I:
    ``pack_experts`` pads it)."""
    if w13.device.type != "cpu" or w13.dtype not in (torch.float32, torch.bfloat16) or w13.dim() != 3:
        return False
    inter, hidden = w13.shape[1] // 2, w13.shape[2]
    return (w13.shape[1] % 2 == 0 and hidden % BLOCK == 0 and inter > 0
            and tuple(w2.shape[1:]) == (hidden, inter))


def inter_multiple(dtype: torch.dtype) -> int:
    """What ``pack_experts`` rounds the intermediate size I of ``dtype`` weights up to: 8 (a packed
    gate/up block holds 8 gate and 8 up channels), or 32 for bf16 weights where the kernel runs AMX,
    whose tiles take the down projection's reduction (K = I) 32 at a time. Without that, an I
    that is not a multiple of 32 sends the down projection to the dot-product tiles: a
    DeepSeek-style layer at I 240 ran a 4,096-token prefill 3.4x slower than at I 224, for the
    price of reading up to 31 zero channels more per expert in decode."""
    return 32 if bf16_on_amx(dtype) else 8


def bf16_on_amx(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` experts run on the AMX tiles here: bf16, the kernel loaded, ``amx`` selected."""
    return dtype == torch.bfloat16 and is_available() and isa() == "amx"


def padded_inter(inter: int, multiple: int = 8) -> int:
    """I rounded up to a multiple of ``multiple`` (see ``inter_multiple``)."""
    return -(-inter // multiple) * multiple


def _pad_inter(w13: torch.Tensor, w2: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w13 [P, 2I, D] (gate rows, then up rows) and w2 [P, D, I] with I zero-padded to
    Ip = ``padded_inter(I, multiple)``: [P, 2Ip, D] and [P, D, Ip]. A zero gate and up channel
    gives SiLU(0) * 0 = 0, which the zero down column adds nowhere: the same outputs for finite
    inputs."""
    slots, two_i, hidden = w13.shape
    inter = two_i // 2
    pad = padded_inter(inter, multiple) - inter
    if pad == 0:
        return w13, w2
    zeros = w13.new_zeros(slots, pad, hidden)
    w13 = torch.cat([w13[:, :inter], zeros, w13[:, inter:], zeros], dim=1)
    w2 = torch.cat([w2, w2.new_zeros(slots, w2.shape[1], pad)], dim=2)
    return w13, w2


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: w [..., C, K] -> (q [..., C, K] int8, scale [..., C] float32),
    w ~= q * scale[..., None]; scale = absmax / 127 (1 for all-zero channels)."""
    wf = w.float()
    scale = wf.abs().amax(dim=-1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(wf / scale[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., C, K] int8, scale [..., C] -> [..., C, K] in ``dtype`` (q * scale, computed in fp32)."""
    return (q.float() * scale[..., None]).to(dtype)


def pack_experts(w13: torch.Tensor, w2: torch.Tensor, quantization: str | None = None, *,
                 multiple: int | None = None) -> PackedExperts:
    """Pack w13 [P, 2I, D] (gate rows, then up rows) and w2 [P, D, I] into the kernel's layout,
    optionally quantized to int8 per output channel. I is zero-padded to Ip = ``padded_inter(I, m)``
    first, m = ``multiple`` (a multiple of 8) or by default ``inter_multiple(w13.dtype)``:
    w13p [P, Ip/8, D, 16], w2p [P, D/16, Ip, 16]."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} or None, got {quantization!r}")
    if multiple is not None and (multiple <= 0 or multiple % 8):
        raise ValueError(f"multiple must be a positive multiple of 8, got {multiple}")
    w13, w2 = _pad_inter(w13, w2, inter_multiple(w13.dtype) if multiple is None else multiple)
    slots, two_i, hidden = w13.shape
    inter = two_i // 2
    empty = torch.empty(0, dtype=torch.float32)
    if quantization == "int8":
        q13, s13 = quantize_int8(w13)  # [P, 2I, D], [P, 2I]
        q2, s2 = quantize_int8(w2)  # [P, D, I], [P, D]
        w13, w2 = q13, q2
        s13 = torch.cat([s13[:, :inter].reshape(slots, inter // 8, 8), s13[:, inter:].reshape(slots, inter // 8, 8)],
                        dim=2).contiguous()
        s2 = s2.reshape(slots, hidden // BLOCK, BLOCK).contiguous()
    else:
        s13 = s2 = empty
    gate = w13[:, :inter].reshape(slots, inter // 8, 8, hidden)
    up = w13[:, inter:].reshape(slots, inter // 8, 8, hidden)
    w13p = _blocks(torch.cat([gate, up], dim=2))  # [P, I/8, D, 16]
    w2p = _blocks(w2.reshape(slots, hidden // BLOCK, BLOCK, inter))  # [P, D/16, I, 16]
    return PackedExperts(w13p, w2p, s13, s2)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    """Column blocks [..., 16, K] (16 output channels, the reduction K) -> the kernel's [..., K, 16]:
    K outermost, and for bf16 in k pairs (memory order [..., K/2, 16, 2], K even), the order
    AVX512-BF16's dot product reads; the FMA tiles widen a pair to its two k rows."""
    if w.dtype != torch.bfloat16:
        return _streamed_copy(w.transpose(-1, -2))
    *lead, cols, k = w.shape
    pairs = w.reshape(*lead, cols, k // 2, 2).permute(*range(len(lead)), -2, -3, -1)  # [..., K/2, 16, 2]
    return _streamed_copy(pairs).reshape(*lead, k, cols)


def _streamed_copy(view: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``view`` for the kernels to stream: on CPU in huge-page memory
    (``moe.host_memory.packed_tensor``: fewer TLB misses per weight read), elsewhere (or with
    ``MOE_HUGE_PAGES=0``) torch's."""
    if view.device.type != "cpu" or not host_memory.huge_pages_wanted():
        return view.contiguous()
    out = host_memory.packed_tensor(view.shape, view.dtype)
    out.copy_(view)
    return out


def unpack_blocks(wp: torch.Tensor) -> torch.Tensor:
    """The inverse of the packing's block order: wp [..., K, 16] -> [..., 16, K] (row c, column k =
    output channel c's weight for input k), for fp32, bf16 (k pairs) and int8 blocks alike."""
    if wp.dtype != torch.bfloat16:
        return wp.transpose(-1, -2)
    *lead, k, cols = wp.shape
    return wp.reshape(*lead, k // 2, cols, 2).permute(*range(len(lead)), -2, -3, -1).reshape(*lead, cols, k)


@dataclass(frozen=True)
class PackedLinear:
    """A [G, C, K] stack of linear weights (G = 1 for one ``nn.Linear``) in the kernel's layout.

    wp: [G, Cp/16, K, 16] float32 or bfloat16, Cp = C rounded up to 16 (zero columns past C);
    out_features: C.
    """

    wp: torch.Tensor
    out_features: int

    def nbytes(self) -> int:
        return self.wp.numel() * self.wp.element_size()


def can_pack_linear(weight: torch.Tensor) -> bool:
    """Whether weight [C, K] or [G, C, K] fits the linear kernel: CPU, float32 or bfloat16 (K even:
    bf16 blocks hold k pairs)."""
    dtype = weight.dtype  # plain comparisons: this runs for every projection of every step
    return (weight.is_cpu and (dtype == torch.float32 or (dtype == torch.bfloat16 and weight.shape[-1] % 2 == 0))
            and weight.dim() in (2, 3) and weight.numel() > 0)


def pack_linear(weight: torch.Tensor) -> PackedLinear:
    """Pack weight [C, K] (an ``nn.Linear``'s, out x in) or [G, C, K] into column blocks of 16
    output channels with K outermost inside a block: wp [G, Cp/16, K, 16]."""
    w = weight.detach()
    if w.dim() == 2:
        w = w[None]
    groups, out_features, k = w.shape
    if w.dtype == torch.bfloat16 and k % 2:
        raise ValueError(f"a bf16 weight packs in k pairs: in_features must be even, got {k}")
    padded = -(-out_features // BLOCK) * BLOCK
    if padded != out_features:
        w = torch.cat([w, w.new_zeros(groups, padded - out_features, k)], dim=1)
    wp = _blocks(w.reshape(groups, padded // BLOCK, BLOCK, k))
    return PackedLinear(wp, out_features)


def linear_forward(x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None = None, *,
                   out_fp32: bool = False) -> torch.Tensor:
    """x @ W^T (+ bias) on packed weights.

    x: [N, K] (G = 1) or [G, N, K], float32 or bfloat16; bias: [C] or [G, C] or None.
    Returns [N, C] or [G, N, C] in x's dtype (float32 with ``out_fp32``).
    """
    squeeze = x.dim() == 2
    x3 = x[None] if squeeze else x
    b = bias if bias is not None else _NONE
    out = torch.ops.moe_kernels.linear_forward(x3, packed.wp, b, packed.out_features, out_fp32)
    return out[0] if squeeze else out


def experts_forward_topk(x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor,
                         packed: PackedExperts) -> torch.Tensor:
    """The routed experts straight from the router's output, in one op: grouping by slot, the
    row gather, the experts and the weighted sum per token.

    x: [T, D] float32 or bfloat16; slot_ids: [T, K] int64 local slots (-1: not computed here);
    weights: [T, K] float32. Returns [T, D] float32: sum over kept k of weights[t, k] *
    expert_{slot_ids[t, k]}(x[t]), summed in slot order like ``Experts.forward``'s index_add_.
    """
    return torch.ops.moe_kernels.experts_forward_topk(x, slot_ids, weights, packed.w13p, packed.s13, packed.w2p,
                                                      packed.s2)


def mla_rope_cache(q: torch.Tensor, latent: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor, interleave: bool, pool: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """MLA's pre-attention step in one op. q: [T, H, Nn + R]; latent: [T, C + R] (kv_a_proj_with_mqa's
    output); norm_weight: [C] (kv_a_layernorm); cos, sin: [T, R/2] float32; pool: [N, S, C + R] one
    layer's cache; slot_mapping: [T] int64. Writes [rmsnorm(latent[:, :C]) | rope(latent[:, C:])] to
    the pool's slots and returns q [T, H, Nn + R] with its last R columns rotated. q, latent, the
    weight and the pool share one dtype (float32 or bfloat16)."""
    return torch.ops.moe_kernels.mla_rope_cache(q, latent, norm_weight, eps, cos, sin, interleave, pool, slot_mapping)


def mla_decode(q: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
               value_dim: int, scale: float, kv_scale: float = 1.0) -> torch.Tensor:
    """MLA absorbed decode attention read straight from the paged latent cache.

    q: [B, H, C + R] absorbed queries (latent part, then rope part); pool: [N, S, C + R] one
    layer's cache in q's dtype (float32 or bfloat16), or float8_e4m3fn holding values / kv_scale
    (``moe.kv_cache``'s fp8 cache); block_tables: [B, nb] int64; context_lens: [B] int64 (each
    sequence's query sees its whole context). Returns [B, H, value_dim] in q's dtype:
    softmax(q latent^T * scale) @ latent[..., :value_dim], softmax in fp32; bf16 inputs round the
    scores and probabilities to bf16 as ``moe.layers.paged.sdpa`` does. An fp8 pool gives the bits
    of the same call on its values dequantized as ``KVLayerView.gather`` does (fp8 x kv_scale in
    fp32, rounded to q's dtype), read from memory as fp8.
    """
    return torch.ops.moe_kernels.mla_decode(q, pool, block_tables, context_lens, value_dim, scale, kv_scale)


def mla_decode_attention(x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...],
                         norms: tuple[torch.Tensor | None, torch.Tensor], eps: tuple[float, float],
                         dims: tuple[int, ...], cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                         pool: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float, kv_scale: float = 1.0) -> torch.Tensor:
    """MLA's whole attention for a step of decode rows only (row b: sequence b's one new token), in
    one op; bit-equal to ``moe.layers.mla.MLAAttention``'s op-by-op kernel path.

    x: [B, D]; weights: packed (q_a or None, q, kv_a, W_UK^T [H, C, Nn], W_UV [H, Vd, C], o) as
    ``pack_linear`` returns their ``wp``; biases: (q_a, q, kv_a, o), each float/x-dtype or None;
    norms: (q_a_layernorm weight or None, kv_a_layernorm weight [C]); eps: theirs; dims: (H, Nn, Vd,
    q_a columns or 0, q columns, D); cos, sin: [B, R/2] float32; pool: [N, S, C + R] (this step's
    entries are written at slot_mapping [B]) in x's dtype, or float8_e4m3fn holding values / kv_scale
    (entries quantized as ``KVLayerView.write`` does, read as ``mla_decode`` reads them);
    block_tables: [B, nb]; context_lens: [B]. Returns o_proj's output [B, D] in x's dtype."""
    run = mla_decode_attention_op(weights, biases, norms, eps, dims, interleave, scale)
    return run(x, cos, sin, pool, slot_mapping, block_tables, context_lens, kv_scale)


def mla_decode_attention_op(weights: tuple[torch.Tensor | None, ...], biases: tuple[torch.Tensor | None, ...],
                            norms: tuple[torch.Tensor | None, torch.Tensor], eps: tuple[float, float],
                            dims: tuple[int, ...], interleave: bool, scale: float) -> Callable[..., torch.Tensor]:
    """``mla_decode_attention`` with one layer's weights and dimensions bound once: returns
    ``run(x, cos, sin, pool, slot_mapping, block_tables, context_lens, kv_scale=1.0)`` (the per-step
    arguments, shaped as ``mla_decode_attention`` takes them) -> [B, D]."""
    q_a, q, kv_a, wuk, wuv, o = weights
    q_a_bias, q_bias, kv_a_bias, o_bias = (b if b is not None else _NONE for b in biases)
    q_a_norm, kv_norm = norms
    head = (q_a if q_a is not None else _NONE, q_a_bias, q_a_norm if q_a_norm is not None else _NONE, eps[0], q,
            q_bias, kv_a, kv_a_bias, kv_norm, eps[1], wuk, wuv, o, o_bias, list(dims))
    op = torch.ops.moe_kernels.mla_decode_attention.default

    def run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor, kv_scale: float = 1.0) -> torch.Tensor:
        return op(x, *head, cos, sin, interleave, pool, slot_mapping, block_tables, context_lens, scale, kv_scale)

    return run


def gqa_decode_attention_op(weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...],
                            norms: tuple[torch.Tensor, torch.Tensor] | None, eps: tuple[float, float],
                            dims: tuple[int, int, int, int], interleave: bool,
                            scale: float) -> Callable[..., torch.Tensor]:
    """Grouped-query attention's whole decode step as one op (``moe_kernels::gqa_decode_attention``),
    bit-equal to ``moe.layers.gqa.GQAAttention``'s op-by-op kernel path, with one layer's weights
    and dimensions bound once.

    weights: packed (q, k, v, o) as ``pack_linear`` returns their ``wp``; biases: theirs or None;
    norms: the per-head (q_norm, k_norm) RMSNorm weights [hd] (Qwen3) or None; eps: theirs; dims:
    (H, Hkv, hd, D). Returns ``run(x [B, D], cos [B, hd/2], sin, pool [N, 2, S, Hkv, hd],
    slot_mapping [B], block_tables [B, nb], context_lens [B], kv_scale=1.0)`` -> o_proj's output
    [B, D] (this step's roped keys and values written to the pool: in x's dtype, or float8_e4m3fn
    holding values / kv_scale, as ``mla_decode_attention``'s)."""
    q, k, v, o = weights
    q_bias, k_bias, v_bias, o_bias = (b if b is not None else _NONE for b in biases)
    q_norm, k_norm = norms if norms is not None else (_NONE, _NONE)
    head = (q, q_bias, k, k_bias, v, v_bias, q_norm, k_norm, eps[0], eps[1], o, o_bias, list(dims))
    op = torch.ops.moe_kernels.gqa_decode_attention.default

    def run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor, kv_scale: float = 1.0) -> torch.Tensor:
        return op(x, *head, cos, sin, interleave, pool, slot_mapping, block_tables, context_lens, scale, kv_scale)

    return run


def moe_ffn(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor | None, *, sigmoid: bool, method: int,
            n_group: int, topk_group: int, top_k: int, norm_topk_prob: bool, scaling: float, log2phy: torch.Tensor,
            logcnt: torch.Tensor, rank: int, slot_load: torch.Tensor, packed: PackedExperts,
            shared: PackedExperts | None, gate_parts: torch.Tensor | None = None, capacity: int | None = None,
            dropped: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE feed-forward of a rank hosting every physical slot (no dispatch) in one op; bit-equal
    to ``moe.moe_layer.MoELayer.forward``'s op-by-op kernel path.

    x: [T, D] float32 or bfloat16; gate_weight: [E, D] float32; bias: [E] float32 (noaux_tc) or None;
    the routing arguments as ``route_topk`` takes them; log2phy: [E, R] int64, logcnt: [E] int64, rank:
    ``choose_replicas``' arguments; slot_load: [P] int64, incremented in place by the assignments per
    slot; packed: the routed experts (P slots); shared: the shared experts as one slot, or None;
    gate_parts: ``router_split(gate_weight)`` or None, as ``router_logits`` takes it; capacity: C
    assignments per slot kept as ``capacity_drop`` keeps them (after slot_load counted the demand), None:
    dropless; dropped: [1] int64 set to the assignments dropped (needed with a capacity).
    Returns [T, D] in x's dtype."""
    run = moe_ffn_op(gate_weight, bias, sigmoid=sigmoid, method=method, n_group=n_group, topk_group=topk_group,
                     top_k=top_k, norm_topk_prob=norm_topk_prob, scaling=scaling, packed=packed, shared=shared,
                     gate_parts=gate_parts)
    return run(x, log2phy, logcnt, rank, slot_load, capacity, dropped)


def moe_ffn_op(gate_weight: torch.Tensor, bias: torch.Tensor | None, *, sigmoid: bool, method: int, n_group: int,
               topk_group: int, top_k: int, norm_topk_prob: bool, scaling: float, packed: PackedExperts,
               shared: PackedExperts | None, gate_parts: torch.Tensor | None = None) -> Callable[..., torch.Tensor]:
    """``moe_ffn`` with one layer's router and expert weights bound once: returns
    ``run(x, log2phy, logcnt, rank, slot_load, capacity=None, dropped=None)`` (the placement, read per
    call since a rebalance replaces it; the capacity, which depends on T) -> [T, D]."""
    parts = gate_parts if gate_parts is not None else _NONE
    routing = (gate_weight, parts, bias if bias is not None else _NONE, sigmoid, method, n_group, topk_group, top_k,
               norm_topk_prob, scaling)
    sh = (shared.w13p, shared.s13, shared.w2p, shared.s2) if shared is not None else (_NONE,) * 4
    weights = (packed.w13p, packed.s13, packed.w2p, packed.s2, *sh)
    op = torch.ops.moe_kernels.moe_ffn.default

    def run(x: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, rank: int, slot_load: torch.Tensor,
            capacity: int | None = None, dropped: torch.Tensor | None = None) -> torch.Tensor:
        if capacity is None:
            return op(x, *routing, log2phy, logcnt, rank, slot_load, *weights, -1, _NO_COUNT)
        if dropped is None:
            raise ValueError("moe_ffn with a capacity needs dropped: a [1] int64 tensor for the count")
        return op(x, *routing, log2phy, logcnt, rank, slot_load, *weights, capacity, dropped)

    return run


def dispatch_plan(x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, num_local_slots: int,
                  num_ranks: int, out: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The expert-parallel AllToAll-v's plan and send buffer in one CPU op: what
    ``parallel.dispatch.plan``'s ``destination_mask``, ``plan_from_mask`` and ``pack_rows`` give, without
    their ~25 tensor ops. x: [T, D]; slot_ids: [T, K] int physical slots (-1 dropped), slot p on rank
    p // num_local_slots; weights: [T, K] float32; out: a (reused) [>= N, row_bytes] uint8 buffer in
    ``parallel.dispatch.plan.row_layout``'s row size that the rows are written into (N is at most
    T x min(K, R)). Returns (send: out's first N rows; pair_token [N] int64, send_counts [R] int64,
    combine_index [N] int64, combine_offsets [T] int64). A slot id outside the R x num_local_slots
    slots raises ValueError naming it."""
    pair_token, counts, combine_index, offsets = torch.ops.moe_kernels.dispatch_plan(
        x, slot_ids, weights, num_local_slots, num_ranks, out)
    return out[: pair_token.numel()], pair_token, counts, combine_index, offsets


def choose_slots(topk_ids: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor, rank: int,
                 slot_load: torch.Tensor) -> torch.Tensor:
    """``moe.moe_layer.choose_replicas`` and the slot-load count in one CPU op. topk_ids: [T, K] int64
    logical experts; log2phy: [E, R] int64 replicas (-1 padded); logcnt: [E] int64; slot_load: [P]
    int64, += each slot's assignments in place. Returns slot_ids [T, K] int64: the n-th assignment of
    expert e (row-major) on replica (n + rank) % logcnt[e]."""
    return torch.ops.moe_kernels.choose_slots(topk_ids, log2phy, logcnt, rank, slot_load)


def experts_forward_rows(x: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor, first_slot: int,
                         packed: PackedExperts, library_min_rows: float = math.inf) -> torch.Tensor | None:
    """An expert-parallel destination's routed experts over the rows it received, in one CPU op.
    x: [M, D] float32 or bfloat16 (rows any stride apart: a view into the receive buffer does);
    slot_ids: [M, K] int32 or int64 physical slots, slot s being local slot s - first_slot where
    that lies in [0, P) and elsewhere (or dropped, -1) otherwise; weights: [M, K] float32. Returns
    [M, D] in x's dtype: each row's weighted expert outputs, each rounded to x's dtype, summed in
    fp32 in k order and rounded once (the values of ``Experts.forward_rows``' tensor ops); None,
    computing nothing, where the rows per busy slot reach ``library_min_rows``."""
    out = torch.ops.moe_kernels.experts_forward_rows(x, slot_ids, weights, first_slot, packed.w13p, packed.s13,
                                                     packed.w2p, packed.s2, float(library_min_rows))
    return None if out.dim() == 1 else out


def capacity_drop(slot_ids: torch.Tensor, weights: torch.Tensor, num_slots: int, capacity: int,
                  limits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Capacity with policy "position" and overflow "drop", no renormalisation, in one CPU op: of each
    slot's assignments in token order (then k) the first ``capacity`` (``limits[slot]`` when given:
    the global scope's share, [num_slots] int64) are kept, the rest get slot -1 and weight 0.
    slot_ids: [T, K] int64 in [0, num_slots) or -1; weights: [T, K]. Returns (slot ids [T, K]
    int64, weights [T, K] float32, dropped): the values ``moe.capacity.apply_capacity`` (with
    limits: ``apply_slot_limits``) gives for those settings, in new tensors."""
    lim = _NO_COUNT if limits is None else limits
    ids, w, dropped = torch.ops.moe_kernels.capacity_drop(slot_ids, weights, num_slots, capacity, lim)
    return ids, w, int(dropped)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [T, D] with weight [D] (both float32 or both bfloat16) -> [T, D] in x's dtype:
    weight * (x / sqrt(mean(x^2) + eps)), statistics in fp32, as ``moe.layers.norm.RMSNorm``."""
    return torch.ops.moe_kernels.rms_norm(x, weight, eps)


def add_rms_norm(h: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the RMSNorm after it in one op: h, r [T, D] and weight [D], all float32
    or all bfloat16 -> (s, y), both [T, D]: s = h + r rounded to the dtype (PyTorch's add),
    y = ``rms_norm(s, weight, eps)``. Bit-equal to those two ops."""
    return torch.ops.moe_kernels.add_rms_norm(h, r, weight, eps)


def router_logits(x: torch.Tensor, weight: torch.Tensor, parts: torch.Tensor | None = None) -> torch.Tensor:
    """The router's logits x @ weight^T in fp32: x [T, D] float32 or bfloat16, weight [E, D] float32 ->
    [T, E] float32. Every row's logits are the same bits whatever the batch it comes in (a fixed
    summation order per row and expert; PyTorch's GEMM may block a batch differently), within fp32
    rounding of ``F.linear(x.float(), weight)``. Where ``router_split_applies`` (bf16 rows on AMX),
    the op multiplies the rows by the weight's bf16 parts on the tiles: ``parts`` =
    ``router_split(weight)`` kept by the caller, or None to make them in the call (same bits)."""
    return torch.ops.moe_kernels.router_logits(x, weight, parts if parts is not None else _NONE)


def router_split(weight: torch.Tensor) -> torch.Tensor:
    """weight [E, D] float32 (D even) as up to three bf16 parts that sum to it exactly, packed for the
    tiles: [S, ceil(E / 16), D / 2, 16, 2] bfloat16 (part p's expert 16 b + n, k = 2 i + c at [p, b, i,
    n, c]; zero past E). Part 0 is bf16(weight), part 1 the bf16 of what it leaves, part 2 the rest;
    S drops trailing parts that are all zero: S = 1 for a weight bf16 holds exactly (a router read
    from a bf16 checkpoint), whose logits then take a third of the tile products."""
    return torch.ops.moe_kernels.router_split(weight)


def router_split_applies(x_dtype: torch.dtype, hidden: int) -> bool:
    """Whether ``router_logits`` on rows of ``x_dtype`` with D = hidden reads the weight's bf16 parts
    (``router_split``) under the instruction set in force: bf16 rows, D a multiple of 32, AMX."""
    return torch.ops.moe_kernels.router_split_applies(x_dtype == torch.bfloat16, hidden)


def gqa_decode(q: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
               scale: float, kv_scale: float = 1.0) -> torch.Tensor:
    """Grouped-query decode attention read straight from the paged cache.

    q: [B, H, hd]; pool: [N, 2, S, Hkv, hd] one layer's cache (each block's keys, then its values) in
    q's dtype (float32 or bfloat16), or float8_e4m3fn holding values / kv_scale as ``mla_decode``'s;
    block_tables: [B, nb] int64; context_lens: [B] int64 (each query sees its whole context).
    Query head h uses kv head h // (H / Hkv). Returns [B, H, hd] in q's dtype, with
    ``mla_decode``'s fp32 softmax and bf16 rounding.
    """
    return torch.ops.moe_kernels.gqa_decode(q, pool, block_tables, context_lens, scale, kv_scale)


def fp8_dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """An fp8 cache's entries x (float8_e4m3fn, any shape, on CPU) times scale, in dtype (float32
    or bfloat16): the bits of ``(x.float() * scale).to(dtype)`` in one pass, converted as the
    decode kernels convert an fp8 cache's rows. Returns a tensor of x's shape."""
    if dtype != torch.float32 and dtype != torch.bfloat16:
        raise ValueError(f"fp8_dequantize gives float32 or bfloat16, not {dtype}")
    return torch.ops.moe_kernels.fp8_dequantize(x, scale, dtype == torch.bfloat16)


def mla_prefill(q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                query_starts: torch.Tensor, value_dim: int, scale: float,
                k_pe: torch.Tensor | None = None) -> torch.Tensor:
    """Causal prefill attention over per-head keys and values in blocks (MLA's naive path).

    q: [T, H, dk], the new rows of B sequences: sequence b's at rows [query_starts[b],
    query_starts[b + 1]), its last positions of context_lens[b]; kv: [N, S, H, dk + value_dim] in
    q's dtype (float32 or bfloat16), head h's key then its value per token, or with k_pe [N, S, R]
    (the keys' last R columns, shared by every head: MLA's rope key) [N, S, H, dk - R + value_dim];
    block_tables: [B, nb] int64; context_lens: [B] int64; query_starts: [B + 1] int64. The row at
    position p sees keys 0..p. Returns [T, H, value_dim] in q's dtype, with ``mla_decode``'s fp32
    softmax and bf16 rounding (the masked ``moe.layers.paged.sdpa`` up to the order of fp32 sums).
    """
    pe = k_pe if k_pe is not None else kv.new_empty(0)
    return torch.ops.moe_kernels.mla_prefill(q, kv, pe, block_tables, context_lens, query_starts, value_dim, scale)


def gqa_prefill(q: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                query_starts: torch.Tensor, scale: float, sliding_window: int | None = None,
                kv_scale: float = 1.0) -> torch.Tensor:
    """Causal grouped-query prefill attention read straight from the paged cache.

    q: [T, H, hd] (rows as ``mla_prefill``'s); pool: [N, 2, S, Hkv, hd] one layer's cache in q's
    dtype (float32 or bfloat16), or float8_e4m3fn holding values / kv_scale (read as
    ``mla_decode`` reads one); block_tables, context_lens, query_starts as ``mla_prefill``'s.
    The row at position p sees keys k with p - sliding_window < k <= p (all k <= p when None).
    Returns [T, H, hd] in q's dtype.
    """
    return torch.ops.moe_kernels.gqa_prefill(q, pool, block_tables, context_lens, query_starts,
                                             sliding_window or 0, scale, kv_scale)


def needs_autograd(*tensors: torch.Tensor | None) -> bool:
    """Whether a product of these tensors must be differentiable: the kernels have no backward,
    so the PyTorch path runs instead (training reuses the serving layers)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def cpu_op_applies(*tensors: torch.Tensor) -> bool:
    """Whether a CPU op of this module can take these tensors: all on CPU, all in one dtype
    (float32 or bfloat16: not an fp8 cache), none needing autograd, and the extension built."""
    dtype = tensors[0].dtype
    if dtype != torch.float32 and dtype != torch.bfloat16:
        return False
    for t in tensors:  # a plain loop: this runs for several ops of every layer of every step
        if t.dtype != dtype:
            return False
    return cpu_kernel_applies(*tensors)


def paged_cache_applies(q: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether ``mla_decode``, ``gqa_decode`` and ``gqa_prefill`` can take queries q over a cache pool: q
    float32 or bfloat16, the pool in q's dtype or float8_e4m3fn (an fp8 cache), both on CPU, no
    autograd, the extension built."""
    if pool.dtype == torch.float8_e4m3fn:
        return (q.dtype == torch.float32 or q.dtype == torch.bfloat16) and cpu_kernel_applies(q, pool)
    return cpu_op_applies(q, pool)


def cpu_kernel_applies(*tensors: torch.Tensor) -> bool:
    """Whether the extension's bookkeeping ops (``capacity_drop``, ``dispatch_plan``), which take
    tensors of any dtype, can: all on CPU, none needing autograd, and the extension built."""
    for t in tensors:
        if not t.is_cpu:
            return False
    return not needs_autograd(*tensors) and is_available()


class TensorWatch:
    """A watch over tensors' in-place versions and data addresses, recorded at construction:
    ``changed()`` says in one C++ loop whether any differs since (``moe.plan_watch``). Holds the
    tensors (in the extension) until it is garbage-collected."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.handle = torch.ops.moe_kernels.tensor_watch_make(list(tensors))
        self._changed = torch.ops.moe_kernels.tensor_watch_changed.default
        self._drop = torch.ops.moe_kernels.tensor_watch_drop.default

    def changed(self) -> bool:
        return self._changed(self.handle)

    def size(self) -> int:
        """How many tensors it watches."""
        return torch.ops.moe_kernels.tensor_watch_size(self.handle)

    def __del__(self) -> None:
        drop = getattr(self, "_drop", None)
        if drop is not None:
            try:
                drop(self.handle)
            except Exception:  # interpreter shutdown: the extension may be gone before this object
                pass


def tensor_watch(tensors: list[torch.Tensor]) -> TensorWatch | None:
    """``TensorWatch(tensors)``, or None when the extension is unavailable."""
    return TensorWatch(tensors) if is_available() else None


def route_topk(logits: torch.Tensor, bias: torch.Tensor | None, *, sigmoid: bool, method: int, n_group: int,
               topk_group: int, top_k: int, norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's selection after its logits [T, E] float32, in one op (``moe.router.Router.route``'s
    arithmetic; method 0 greedy, 1 group_limited_greedy, 2 noaux_tc with ``bias`` [E]). Returns ids
    [T, top_k] int64, highest selection first (ties: lower id), and weights [T, top_k] float32."""
    return torch.ops.moe_kernels.route_topk(logits, bias if bias is not None else _NONE, sigmoid, method, n_group,
                                            topk_group, top_k, norm_topk_prob, scaling)


def prefers_library_gemm(dtype: torch.dtype, mean_rows: float) -> bool:
    """Whether groups of ``mean_rows`` rows in ``dtype`` run faster as PyTorch's GEMMs here:
    prefill-size groups in a dtype this CPU has a fast library GEMM for. bf16 counts as fast with
    AMX, or with AVX512-BF16 whose dot product out-runs the fp32 FMA (``bf16_dot_rate``); where it
    runs at half the FMA's rate oneDNN's bf16 GEMM does too (76 against 139 GFLOP/s for fp32 on
    an Intel core without AMX) and the kernel's FMA tiles are faster."""
    if mean_rows < LIBRARY_GEMM_MIN_ROWS:
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and has_fast_bf16_gemm() and (has_amx_bf16() or bf16_dot_rate() >= 1.0)


def prefers_library_experts(dtype: torch.dtype, mean_rows: float) -> bool:
    """``prefers_library_gemm`` for SwiGLU experts (routed groups of ``mean_rows`` rows each, or a dense
    MLP as one group): the same, except on AMX, where the kernel's bf16 tiles out-run PyTorch's
    per-expert GEMMs at every row count measured (1.26-1.58x at 256-4096 rows per expert, one
    thread, ``docs/benchmarks.md``), so bf16 experts stay on the kernel: a row's values then do not
    depend on how many rows its expert got (``pack_experts`` pads I to a multiple of 32 there; packed
    unpadded, I 40 or 264 gave 5e-7 to 8e-7 between a row alone and in a 2-100-row call)."""
    if not prefers_library_gemm(dtype, mean_rows):
        return False
    return not bf16_on_amx(dtype)


def bf16_dot_rate() -> float:
    """The AVX512-BF16 dot product's flop rate over the fp32 FMA's on this core (both on 512-bit
    registers), probed by the first process on this CPU (``agree_bf16_dot_rate``); 0.0 where the
    CPU lacks the dot product, or the kernel is not loaded."""
    if not is_available():
        return 0.0
    return float(torch.ops.moe_kernels.bf16_dot_rate())


def cache_dir() -> Path:
    """Where the compiled extension lives: $MOE_KERNEL_CACHE or ~/.cache/moe_kernels, one folder
    per (source hash, torch, Python, machine)."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    key = f"{digest.hexdigest()[:16]}-torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-" \
          f"{platform.machine()}"
    root = Path(os.environ.get("MOE_KERNEL_CACHE") or Path.home() / ".cache" / "moe_kernels")
    return root / key.replace("+", "_")


# A build lock older than this belongs to a process that died while compiling (a compile takes
# well under a minute of CPU); torch's baton would wait for it forever.
STALE_LOCK_S = 600.0
LIBRARY = "moe_kernels_cpu.so"
# -fopenmp: at::parallel_for is a header template that runs serially unless the extension itself
# is built with OpenMP; at run time libgomp.so.1 resolves to the copy torch already loaded, so
# torch.set_num_threads governs the kernels' threads too.
CFLAGS = ("-O3", "-ffp-contract=fast", "-fno-math-errno", "-fopenmp")
LDFLAGS = ("-fopenmp",)
COMPLETE = "complete"  # written (atomically) after a successful build


def build(verbose: bool = False) -> Path:
    """Compile (or reuse the cached build of) the extension and load it into torch.ops.
    Returns the build directory. Raises on compiler errors.

    A finished build is loaded directly (``torch.ops.load_library``): no compiler check and no
    build lock, so a process killed while loading (tests kill ranks) cannot leave a lock that
    would stall every later load. Only a missing build takes torch's lock and compiles."""
    directory = cache_dir()
    library = directory / LIBRARY
    if (directory / COMPLETE).exists() and library.exists():
        torch.ops.load_library(str(library))
        return directory
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    _remove_stale_lock(directory / "lock")
    cpp_extension.load(
        name="moe_kernels_cpu", sources=[str(SOURCE_DIR / "experts_cpu.cpp")], build_directory=str(directory),
        # fresh lists: cpp_extension appends to the ones it is given
        extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), extra_include_paths=[str(SOURCE_DIR)],
        is_python_module=False, verbose=verbose,
    )
    partial = directory / f".{COMPLETE}.{os.getpid()}"
    partial.write_text(f"{LIBRARY}\n")
    os.replace(partial, directory / COMPLETE)
    return directory


def _remove_stale_lock(lock: Path) -> None:
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
            log.warning("moe.kernels: removed a stale build lock %s (its process died while compiling)", lock)
    except FileNotFoundError:
        pass


def build_failure(e: BaseException) -> str:
    """One line for a failed ``build``: the compiler's (or assembler's) first error, where its output
    holds one (the exception's last line is ninja's "build stopped" or a failed load), else that last
    line."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    for line in lines:
        if ": error:" in line or ": Error:" in line or ": fatal error:" in line:
            return line
    return lines[-1] if lines else type(e).__name__


@functools.cache
def is_available() -> bool:
    """Build/load the extension once per process; False (with one log line) when it cannot be
    built or ``MOE_CPU_KERNEL=0``."""
    if os.environ.get("MOE_CPU_KERNEL", "1") == "0":
        return False
    try:
        build()
    except Exception as e:  # no compiler, no headers, a read-only cache: the PyTorch path runs instead
        log.warning("moe.kernels: CPU expert kernel unavailable, using the PyTorch path (%s)", build_failure(e))
        return False
    settled()
    return True


_settled: tuple[str, float, dict[int, tuple[float, float]], float] | None = None


def settled() -> tuple[str, float, dict[int, tuple[float, float]], float]:
    """``settle_isa``'s answer, settled once per process (its variables' warnings said once): the
    loaded build's first call settles, later ones return the same."""
    global _settled
    if _settled is None:
        _settled = settle_isa()
    return _settled


def settle_isa() -> tuple[str, float, dict[int, tuple[float, float]], float]:
    """After the build loaded: take this CPU's agreed bf16 dot rate (``agree_bf16_dot_rate``), then
    select the instruction set ``$MOE_KERNEL_ISA`` names or the fastest by that rate, then settle
    how dot tiles stream their weights (``agree_tile_modes``) and how the dot path's decode attention
    asks for its rows (``agree_attention_asks``). Returns (the instruction set, the rate, each row
    class's chosen modes' probed speed over the default's, the ask mode's)."""
    rate = agree_bf16_dot_rate()
    chosen = select_isa_from_env()
    return chosen, rate, agree_tile_modes(), agree_attention_asks()


PROBES_FILE = "cpu_probes.json"
# How dot tiles stream their weights from DRAM (decode's weight streams), bits of the mode
# (experts_cpu.cpp's TILE_*):
TILE_PREFETCH = 1  # the weight lines asked for ahead in software, into L1
TILE_ONE_STREAM = 2  # a pair of column blocks read one block after the other (else side by side)
TILE_PREFETCH_L2 = 4  # with TILE_PREFETCH: into L2 instead
# The modes of tiles over block pairs (linears, prefill-size experts), in the order the probe
# (``tile_mode_seconds``) answers, then those of tiles over single blocks (decode-size routed experts:
# no order to choose), in the order that follows.
TILE_PAIR_MODES = {0: "side by side", 1: "side by side + prefetch", 2: "one stream", 3: "one stream + prefetch",
                   5: "side by side + L2 prefetch", 7: "one stream + L2 prefetch"}
TILE_BLOCK_MODES = {0: "no prefetch", 1: "prefetch", 5: "L2 prefetch"}
# Each class of row counts has its own modes: (the rows the probe runs for it, its name, the variable
# that forces a mode for this process: a TILE_PAIR_MODES key, single blocks taking its prefetch bits;
# unset or "auto": the probe's fastest). Tiles have DOT_TILE_ROWS (12) rows at most.
TILE_ROW_CLASSES = ((1, "one row", "MOE_ONE_ROW_MODE"), (2, "two rows", "MOE_TWO_ROW_MODE"),
                    (4, "3-4 rows", "MOE_FEW_ROWS_MODE"), (8, "5+ rows", "MOE_ROWS_MODE"))
# The weights the probe streams (flushed from the caches before each pass), and how much faster than
# the default mode (1, the tiles as they were before the probe) another must be to be taken.
TILE_PROBE_BYTES = 32 << 20
TILE_MIN_GAIN = 1.05
# the seconds a probe's pass can take (a saved list with a time outside is probed again)
TILE_PROBE_SECONDS = (1e-6, 10.0)
# the classes whose modes a variable forced in this process (their rows; ``agree_tile_modes``)
_forced_tile_classes: set[int] = set()


def cpu_signature() -> str:
    """This CPU's model and feature flags (/proc/cpuinfo's first processor), hashed: machines that
    share it share the probe's answer."""
    fields = {"model name", "cpu family", "model", "stepping", "flags"}
    lines = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key = line.split(":", 1)[0].strip()
                if key in fields:
                    lines.append(line.strip())
    except OSError:
        pass
    text = "\n".join(lines) or f"{platform.machine()} {platform.processor()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _number(value: object) -> bool:
    """A finite JSON number (an integer too large for a float is none)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _saved_probes() -> dict[str, Any]:
    """This CPU's probes saved beside the build ({} when there are none, the file is unreadable or it
    holds another CPU's)."""
    try:
        saved = json.loads((cache_dir() / PROBES_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) and saved.get("cpu") == cpu_signature() else {}


def _saved_probe(key: str) -> Any:
    """The probe ``key`` (a number or a list of numbers) the first process on this CPU saved beside the
    build, or None."""
    value = _saved_probes().get(key)
    if _number(value):
        return float(value)
    if isinstance(value, list) and all(_number(v) for v in value):
        return [float(v) for v in value]
    return None


def _save_probe(key: str, value: float | list[float]) -> None:
    """Keep ``value`` under ``key`` beside the build with this CPU's other probes (another CPU's are
    replaced); an unwritable cache keeps it in this process only."""
    path = cache_dir() / PROBES_FILE
    saved = _saved_probes() or {"cpu": cpu_signature()}
    saved[key] = value
    try:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(saved) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        log.debug("moe.kernels: probe %s not saved (%s)", key, e)


def agree_bf16_dot_rate() -> float:
    """The bf16 dot rate this process picks its tiles by: the one the first process on this CPU
    probed, read from the kernel's cache folder (keyed by ``cpu_signature``), else probed now and
    written there. A rate near 1.0 could otherwise pick the dot tiles in one process and the FMA
    tiles in another (their bf16 results differ in the last bits), e.g. the driver and its Ray
    workers. An unwritable cache keeps the probe of this process."""
    saved = _saved_probe("rate")
    if isinstance(saved, float):
        return float(torch.ops.moe_kernels.set_bf16_dot_rate(saved))
    rate = float(torch.ops.moe_kernels.bf16_dot_rate())
    _save_probe("rate", rate)
    return rate


def _probe_key(rows: int) -> str:
    return f"tile_seconds_{rows}"


def _fastest_mode(seconds: list[float], modes: list[int], default: int = TILE_PREFETCH) -> int:
    """The mode of ``modes`` (probed ``seconds`` in their order) to run: the fastest where it is at
    least ``TILE_MIN_GAIN`` times faster than ``default``, else ``default``."""
    fastest = modes[min(range(len(modes)), key=seconds.__getitem__)]
    return fastest if seconds[modes.index(default)] >= TILE_MIN_GAIN * seconds[modes.index(fastest)] else default


def _valid_tile_probe(seconds: object, count: int) -> bool:
    """Whether ``seconds`` is a probe of ``count`` passes, each within ``TILE_PROBE_SECONDS``."""
    low, high = TILE_PROBE_SECONDS
    return isinstance(seconds, list) and len(seconds) == count and all(low <= t <= high for t in seconds)


def agree_tile_modes() -> dict[int, tuple[float, float]]:
    """Settle how dot tiles stream their weights, for each class of ``TILE_ROW_CLASSES``, over block
    pairs (``TILE_PAIR_MODES``) and over single blocks (``TILE_BLOCK_MODES``): the class's variable
    when set, else the modes this CPU's probe found fastest for its rows (kept beside the build like
    the dot rate; a saved probe that is not one, e.g. of an earlier build's modes, is probed again)
    where they beat mode 1 by ``TILE_MIN_GAIN`` (AMD Zen 4: block pairs in one stream, 1.2-1.4x;
    single blocks of 5 rows or more prefetched into L2, 1.3-1.5x). Every mode gives the same bits.
    Returns, keyed by each class's probed rows, the chosen modes' probed speed over mode 1's (pairs,
    single blocks; 1.0 without AVX512-BF16: no dot tiles)."""
    pair_modes, block_modes = list(TILE_PAIR_MODES), list(TILE_BLOCK_MODES)
    count = len(pair_modes) + len(block_modes)
    gains = {}
    _forced_tile_classes.clear()
    for rows, _, env in TILE_ROW_CLASSES:
        seconds = _saved_probe(_probe_key(rows))
        # [] is this CPU's answer without AVX512-BF16 (no dot tiles): kept, not probed and written again
        if seconds != [] and not _valid_tile_probe(seconds, count):
            seconds = [float(t) for t in torch.ops.moe_kernels.tile_mode_seconds(rows, TILE_PROBE_BYTES)]
            _save_probe(_probe_key(rows), seconds)
        pair, block = TILE_PREFETCH, TILE_PREFETCH
        probed = _valid_tile_probe(seconds, count)
        pair_seconds, block_seconds = seconds[:len(pair_modes)], seconds[len(pair_modes):]
        if probed:
            pair, block = _fastest_mode(pair_seconds, pair_modes), _fastest_mode(block_seconds, block_modes)
        wanted = env_choice(env)
        if wanted in (str(m) for m in pair_modes):
            pair = int(wanted)
            block = pair & ~TILE_ONE_STREAM  # single blocks take its prefetch bits
            _forced_tile_classes.add(rows)
        elif wanted != "auto":
            log.warning("moe.kernels: %s=%r not used (expected one of %s or auto)", env, os.environ[env],
                        ", ".join(map(str, pair_modes)))
        torch.ops.moe_kernels.set_tile_mode(rows, 2, pair)
        torch.ops.moe_kernels.set_tile_mode(rows, 1, block)
        gains[rows] = ((pair_seconds[pair_modes.index(TILE_PREFETCH)] / pair_seconds[pair_modes.index(pair)],
                        block_seconds[block_modes.index(TILE_PREFETCH)] / block_seconds[block_modes.index(block)])
                       if probed else (1.0, 1.0))
    return gains


# How the dot path's decode attention asks for its key rows ahead of its score tiles
# (experts_cpu.cpp's ATTENTION_ASKS_*), in the order the probe answers; "0" / "1" in the variable
# force one for this process, unset or "auto" takes the probe's.
ATTENTION_ASKS = {0: "into L1, 2 tiles ahead", 1: "into L2, 8 tiles ahead"}
ATTENTION_ASKS_ENV = "MOE_ATTENTION_ASKS"
# The probe: the MLA decode op (DeepSeek's latent 256 + rope 32, 16 heads) over this many sequences
# of this many tokens in shuffled blocks of 16, every call after a write of more than the last-level
# cache (rows come from DRAM, as between two layers of a decode step).
ATTENTION_PROBE_SEQUENCES, ATTENTION_PROBE_TOKENS = 4, 4096
ATTENTION_PROBE_EVICT_BYTES = 96 << 20
# rounds of the probe (the best of them per mode, the modes alternating within each): on AMD Zen 4 the
# L2 mode's gain over the L1 mode read 1.06-1.22x from one 5-round probe to the next, and 1.00x once,
# just after the build had compiled; 9 rounds take ~0.2 s once per CPU
ATTENTION_PROBE_REPEATS = 9


def attention_asks_seconds(repeats: int = ATTENTION_PROBE_REPEATS) -> list[float]:
    """Seconds (CPU, best of ``repeats``) of the dot path's MLA decode op on rows in DRAM in each ask
    mode (``ATTENTION_ASKS`` order); [] where the selected instruction set has no such path (the
    dot tiles' ``avx512bf16`` alone: AMX runs its own). Every mode gives the same bits. Call it
    with the kernel loaded (``settle_isa`` does)."""
    if isa() != "avx512bf16":
        return []
    gen = torch.Generator().manual_seed(0)
    block, heads, latent, rope = 16, 16, 256, 32
    blocks = ATTENTION_PROBE_SEQUENCES * ATTENTION_PROBE_TOKENS // block
    pool = (torch.randn(blocks + 1, block, latent + rope, generator=gen) / 4).bfloat16()
    tables = torch.randperm(blocks, generator=gen).view(ATTENTION_PROBE_SEQUENCES, -1)
    lens = torch.full((ATTENTION_PROBE_SEQUENCES,), ATTENTION_PROBE_TOKENS, dtype=torch.long)
    q = (torch.randn(ATTENTION_PROBE_SEQUENCES, heads, latent + rope, generator=gen) / 4).bfloat16()
    evict = torch.zeros(ATTENTION_PROBE_EVICT_BYTES // 4, dtype=torch.int32)
    before, threads = int(torch.ops.moe_kernels.attention_asks()), torch.get_num_threads()
    best = [float("inf")] * len(ATTENTION_ASKS)
    torch.set_num_threads(1)  # the calling thread's CPU time is the whole op's
    try:
        for _ in range(repeats):
            for i, mode in enumerate(ATTENTION_ASKS):
                torch.ops.moe_kernels.set_attention_asks(mode)
                evict.add_(1)
                start = time.thread_time()
                torch.ops.moe_kernels.mla_decode(q, pool, tables, lens, latent, 0.1)
                best[i] = min(best[i], time.thread_time() - start)
    finally:
        torch.ops.moe_kernels.set_attention_asks(before)
        torch.set_num_threads(threads)
    return best


def agree_attention_asks() -> float:
    """Settle how the dot path's decode attention asks for its key rows (``ATTENTION_ASKS``):
    ``$MOE_ATTENTION_ASKS`` when set, else the mode this CPU's probe (``attention_asks_seconds``, kept
    beside the build like the others) found fastest where it beats mode 0 by ``TILE_MIN_GAIN`` (AMD
    Zen 4: into L2, ~1.1x at 2,048 tokens of context). Returns the chosen mode's probed speed over mode
    0's (1.0 where not probed: no dot path selected)."""
    count = len(ATTENTION_ASKS)
    seconds = _saved_probe("attention_asks_seconds")
    if not _valid_tile_probe(seconds, count):
        seconds = attention_asks_seconds()
        if seconds:  # [] where another instruction set is selected: nothing to keep
            _save_probe("attention_asks_seconds", seconds)
    probed = _valid_tile_probe(seconds, count)
    mode = _fastest_mode(seconds, list(ATTENTION_ASKS), default=0) if probed else 0
    wanted = env_choice(ATTENTION_ASKS_ENV)
    if wanted in (str(m) for m in ATTENTION_ASKS):
        mode = int(wanted)
    elif wanted != "auto":
        log.warning("moe.kernels: %s=%r not used (expected 0, 1 or auto)", ATTENTION_ASKS_ENV,
                    os.environ[ATTENTION_ASKS_ENV])
    torch.ops.moe_kernels.set_attention_asks(mode)
    return seconds[0] / seconds[mode] if probed else 1.0


def attention_asks_text() -> str | None:
    """How the dot path's decode attention asks for its rows in this process ("into L2, 8 tiles
    ahead"); None where the kernel is unavailable or the selected instruction set runs another path."""
    if not is_available() or isa() != "avx512bf16":
        return None
    return ATTENTION_ASKS[int(torch.ops.moe_kernels.attention_asks())]


# the bytes of one block pair ``tile_mode_seconds`` passes over (two blocks of K 1024 x 16 bf16)
ONE_ROW_PROBE_PAIR_BYTES = 2 * 1024 * 16 * 2


def one_row_read_bandwidth(num_bytes: int) -> float | None:
    """Bytes/s of the one-row dot tiles' fastest pass over ``num_bytes`` (rounded down to whole block
    pairs, ``ONE_ROW_PROBE_PAIR_BYTES``; at least one) of packed weights, every line flushed from the
    caches before each pass (``agree_tile_modes``' probe for one row, run now: ~1 s for 256 MiB), the
    rate a decode step's weight stream can reach on this core; None where no dot tiles run (no
    AVX512-BF16) or the extension is unavailable. Smaller sizes read faster after the flush (AMD Zen 4:
    40-41 GB/s over 8-32 MiB, 33 over 128-256 MiB), so a DRAM rate needs several times the last-level
    cache."""
    if not is_available():
        return None
    read = max(1, num_bytes // ONE_ROW_PROBE_PAIR_BYTES) * ONE_ROW_PROBE_PAIR_BYTES
    seconds = [float(t) for t in torch.ops.moe_kernels.tile_mode_seconds(1, read)]
    best = min(seconds, default=0.0)  # block pairs' modes and single blocks' over the same bytes
    return read / best if 0 < best < 1e29 else None


def tile_mode(rows: int, blocks: int = 2) -> int:
    """How dot tiles of ``rows`` rows over block pairs (``blocks`` 2, ``TILE_PAIR_MODES``) or single
    blocks (1, ``TILE_BLOCK_MODES``) stream their weights in this process (``agree_tile_modes``)."""
    return int(torch.ops.moe_kernels.tile_mode(rows, blocks))


# the instruction sets that run the dot tiles, so the tile modes
DOT_ISAS = ("amx", "avx512bf16")


def tile_modes_text(gains: dict[int, tuple[float, float]] | None = None) -> str | None:
    """The tile modes in force, a class after the other ("one row: pairs one stream, blocks no
    prefetch; two rows: ..."; a class a variable forced names it), with ``agree_tile_modes``' gains
    where given; None where the kernel is unavailable or the selected instruction set runs no dot
    tiles (the modes then change nothing)."""
    if not is_available() or isa() not in DOT_ISAS:
        return None
    parts = []
    for rows, name, env in TILE_ROW_CLASSES:
        pair, block = TILE_PAIR_MODES[tile_mode(rows, 2)], TILE_BLOCK_MODES[tile_mode(rows, 1)]
        if gains is not None and rows in gains:
            pair, block = f"{pair} ({gains[rows][0]:.2f}x)", f"{block} ({gains[rows][1]:.2f}x)"
        parts.append(f"{name}: pairs {pair}, blocks {block}" + (f" (set by {env})" if rows in _forced_tile_classes
                                                                 else ""))
    return "; ".join(parts)


def env_choice(name: str) -> str:
    """A kernel variable's value as chosen: stripped and lower-cased, "auto" where unset or empty."""
    return os.environ.get(name, "").strip().lower() or "auto"


def select_isa_from_env() -> str:
    """Select the instruction set ``$MOE_KERNEL_ISA`` names (unset: the fastest here); a name that is
    unknown or that this CPU lacks logs one line and selects the fastest. Returns the one selected."""
    wanted = env_choice(ISA_ENV)
    try:
        return select_isa(wanted)
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[0].removeprefix("moe_kernels: ")
        chosen = select_isa("auto")
        log.warning("moe.kernels: %s=%r not used (%s); running %s", ISA_ENV, os.environ[ISA_ENV], reason, chosen)
        return chosen


def isa() -> str:
    """The instruction set the loaded kernel runs: "amx", "avx512bf16", "avx512", "avx2" or "generic"."""
    return str(torch.ops.moe_kernels.isa_name())


def supported_isas() -> list[str]:
    """The instruction sets this CPU runs the kernel with (``ISAS`` order); leaves the current one selected."""
    current = isa()
    found = []
    for name in ISAS:
        try:
            select_isa(name)
        except RuntimeError:
            continue
        found.append(name)
    select_isa(current)
    return found


def select_isa(name: str) -> str:
    """Force an instruction set ("auto", "amx", "avx512bf16", "avx512", "avx2", "generic"); raises if
    the CPU lacks it."""
    return str(torch.ops.moe_kernels.select_isa(name))


def experts_forward(x_sorted: torch.Tensor, counts: list[int], packed: PackedExperts,
                    row_weights: torch.Tensor | None = None, *, out_fp32: bool = False) -> torch.Tensor:
    """SwiGLU experts over rows grouped by slot with packed weights.

    x_sorted: [N, D] float32 or bfloat16; counts: P ints summing to N; row_weights: [N] or None.
    Returns: [N, D] (x's dtype, or float32 with ``out_fp32``), row n scaled by row_weights[n].
    """
    weights = row_weights if row_weights is not None else _NONE
    return torch.ops.moe_kernels.experts_forward(x_sorted, counts, packed.w13p, packed.s13, packed.w2p,
                                                 packed.s2, weights, out_fp32)
