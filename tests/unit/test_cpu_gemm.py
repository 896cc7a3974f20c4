"""moe/cpu_gemm.py: the oneDNN switch is scoped and restored; grouped experts whose one-row
slots run as native GEMVs still compute the SwiGLU experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moe.cpu_gemm
import moe.experts
import moe.kernels
from moe.cpu_gemm import has_fast_bf16_gemv, native_gemv, onednn_allows, onednn_isa_ceiling, use_native_gemv
from moe.experts import grouped_expert_forward


def test_native_gemv_switches_onednn_off_and_restores_it():
    assert torch.backends.mkldnn.enabled
    with native_gemv():
        assert not torch.backends.mkldnn.enabled
    assert torch.backends.mkldnn.enabled
    with pytest.raises(RuntimeError, match="boom"), native_gemv():
        raise RuntimeError("boom")
    assert torch.backends.mkldnn.enabled
    with native_gemv(enabled=False):
        assert torch.backends.mkldnn.enabled


def test_native_gemv_only_for_bf16_on_cpu():
    assert not use_native_gemv(torch.float32, "cpu")
    assert not use_native_gemv(torch.bfloat16, "meta")
    assert use_native_gemv(torch.bfloat16, torch.device("cpu")) == has_fast_bf16_gemv()


def test_onednn_isa_ceiling_reads_the_variable_oneDNN_reads():
    assert onednn_isa_ceiling({}) is None
    assert onednn_isa_ceiling({"ONEDNN_MAX_CPU_ISA": "avx512_core_bf16"}) == "AVX512_CORE_BF16"
    assert onednn_isa_ceiling({"DNNL_MAX_CPU_ISA": "AVX2"}) == "AVX2"  # the older name
    assert onednn_isa_ceiling({"ONEDNN_MAX_CPU_ISA": "ALL", "DNNL_MAX_CPU_ISA": "AVX2"}) is None
    assert onednn_isa_ceiling({"ONEDNN_MAX_CPU_ISA": "no such isa"}) is None  # oneDNN ignores it too


@pytest.mark.parametrize("ceiling, bf16, amx", [
    (None, True, True), ("DEFAULT", True, True), ("AVX2", False, False), ("AVX512_CORE_VNNI", False, False),
    ("AVX512_CORE_BF16", True, False), ("AVX10_1_512", True, False), ("AVX512_CORE_AMX", True, True),
    ("AVX10_2_512", True, False), ("AVX10_2_512_AMX_2", True, True),
])
def test_onednn_allows_follows_the_ceiling(ceiling, bf16, amx):
    env = {} if ceiling is None else {"ONEDNN_MAX_CPU_ISA": ceiling}
    assert onednn_allows("avx512_bf16", env) is bf16
    assert onednn_allows("amx_bf16", env) is amx
    with pytest.raises(ValueError, match="unknown feature"):
        onednn_allows("avx2", env)


def test_a_ceiling_below_amx_keeps_bf16_experts_off_onednn(monkeypatch):
    """On an AMX machine run with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16, oneDNN's bf16 GEMMs run at the
    AVX512-BF16 dot product's rate: prefill-size bf16 groups must not be sent to them as if AMX ran them."""
    monkeypatch.setattr(moe.cpu_gemm, "_cpu_has", lambda f: f in ("avx512_bf16", "amx_bf16"))
    monkeypatch.setattr(moe.kernels, "bf16_dot_rate", lambda: 0.5)
    for fn in (moe.cpu_gemm.has_amx_bf16, moe.cpu_gemm.has_fast_bf16_gemm):
        fn.cache_clear()
    try:
        rows = 4 * moe.kernels.LIBRARY_GEMM_MIN_ROWS
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
        assert moe.kernels.prefers_library_gemm(torch.bfloat16, rows)
        moe.cpu_gemm.has_amx_bf16.cache_clear()
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
        assert not moe.cpu_gemm.has_amx_bf16()
        assert not moe.kernels.prefers_library_gemm(torch.bfloat16, rows)
        assert moe.kernels.prefers_library_gemm(torch.float32, rows)  # fp32 GEMMs are unaffected
    finally:
        for fn in (moe.cpu_gemm.has_amx_bf16, moe.cpu_gemm.has_fast_bf16_gemm):
            fn.cache_clear()


def _reference(x, counts, w13, w2, row_weights):
    """Per-slot SwiGLU in float32: [N, D]."""
    out, start, inter = [], 0, w2.shape[-1]
    for slot, n in enumerate(counts):
        h = x[start:start + n] @ w13[slot].t()
        out.append((F.silu(h[:, :inter]) * h[:, inter:] * row_weights[start:start + n, None]) @ w2[slot].t())
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("force_gemv", [False, True])
def test_grouped_experts_with_one_row_slots(monkeypatch, force_gemv):
    if force_gemv:  # take the GEMV path on any CPU, not only AVX512-BF16 ones
        monkeypatch.setattr(moe.experts, "use_native_gemv", lambda dtype, device: True)
    g = torch.Generator().manual_seed(0)
    num_slots, d, inter = 5, 64, 32
    w13 = torch.randn(num_slots, 2 * inter, d, generator=g) / d**0.5
    w2 = torch.randn(num_slots, d, inter, generator=g) / inter**0.5
    counts = [1, 0, 3, 1, 2]  # one-row, empty and several-row slots
    x = torch.randn(sum(counts), d, generator=g)
    row_weights = torch.rand(sum(counts), generator=g)
    ref = _reference(x, counts, w13, w2, row_weights)
    fp32 = grouped_expert_forward(x, counts, w13, w2, row_weights)
    assert fp32.shape == (7, d) and fp32.dtype == torch.float32
    torch.testing.assert_close(fp32, ref, rtol=1e-5, atol=1e-5)
    bf16 = grouped_expert_forward(x.bfloat16(), counts, w13.bfloat16(), w2.bfloat16(), row_weights)
    assert bf16.shape == (7, d) and bf16.dtype == torch.bfloat16
    assert (bf16.float() - ref).abs().max().item() <= 0.03 * ref.abs().max().item()
    assert torch.backends.mkldnn.enabled
