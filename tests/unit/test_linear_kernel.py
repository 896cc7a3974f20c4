"""moe/kernels linear_forward and moe.layers.Linear: the packed linear kernel against F.linear.

Covers output widths that are not a multiple of the 16-column block, row counts across the
96-row panels, batched per-head weights ([G, C, K], MLA's absorbed products), bias, fp32 and
bf16, every instruction set this CPU runs; the module keeps nn.Linear's behaviour (state dict,
TP slicing, in-place weight writes, autograd) and MLA's absorbed decode gives the einsum's
result on the kernel. The extension is built by the session fixture ``kernel_isas``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe import kernels
from moe.config import ModelConfig
from moe.layers import Linear, MLAAttention, shard_linear_
from moe.layers import paged as paged_mod

SHAPES = [  # (G, N, K, C)
    (1, 1, 64, 40),  # one decode row, C % 16 = 8
    (1, 7, 100, 16),  # odd K, one block
    (3, 13, 96, 33),  # batched heads, C % 16 = 1
    (2, 200, 64, 17),  # three 96-row panels
    (1, 40, 48, 40),  # two-block items on AVX-512 and a last item of one block
    (1, 400, 64, 80),  # dot tiles: five panels of items over all five blocks (pairs, the last alone)
    (1, 0, 32, 16),  # no rows
]


@pytest.mark.parametrize(("g", "n", "k", "c"), SHAPES)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.bfloat16, 1e-2)])
def test_linear_forward_matches_reference(kernel_isas: list[str], g: int, n: int, k: int, c: int,
                                          dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(g * 1000 + n)
    x = torch.randn(g, n, k, generator=gen).to(dtype)
    w = (torch.randn(g, c, k, generator=gen) / k**0.5).to(dtype)
    bias = torch.randn(g, c, generator=gen)
    packed = kernels.pack_linear(w)
    assert packed.wp.shape == (g, -(-c // 16), k, 16) and packed.out_features == c
    want = torch.einsum("gnk,gck->gnc", x.double(), w.double()) + bias[:, None].double()  # [G, N, C]
    for isa in kernel_isas:
        kernels.select_isa(isa)
        got = kernels.linear_forward(x, packed, bias, out_fp32=True)
        assert got.shape == (g, n, c) and got.dtype == torch.float32
        if n:
            assert (got.double() - want).abs().max().item() < tol * want.abs().max().item(), isa
        rounded = kernels.linear_forward(x, packed, bias)  # x's dtype: the fp32 result rounded once
        assert rounded.dtype == dtype and torch.equal(rounded, got.to(dtype))
    kernels.select_isa("auto")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_forward_reads_strided_rows_as_their_contiguous_copy(kernel_isas: list[str], dtype: torch.dtype) -> None:
    """MLA's absorbed products hand the kernel [H, B, K] views of [B, H, K + R] rows (the dot tiles
    read them where they lie): the result is the contiguous copy's, bit for bit, on every ISA."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(26, 3, 40 + 8, generator=gen).to(dtype)  # [B, H, K + R]
    view = rows[:, :, :40].permute(1, 0, 2)  # [H, B, K], columns contiguous, rows 3 * 48 apart
    packed = kernels.pack_linear((torch.randn(3, 33, 40, generator=gen) / 40**0.5).to(dtype))
    columns = torch.randn(3, 26, 80, generator=gen).to(dtype)[:, :, ::2]  # a column stride of 2
    for isa in kernel_isas:
        kernels.select_isa(isa)
        want = kernels.linear_forward(view.contiguous(), packed)
        got = kernels.linear_forward(view, packed)
        assert got.shape == (3, 26, 33) and got.is_contiguous() and torch.equal(got, want), isa
        assert torch.equal(kernels.linear_forward(columns, packed), kernels.linear_forward(columns.contiguous(), packed))
    kernels.select_isa("auto")


def test_linear_forward_two_dim_input_and_errors(kernel_isas: list[str]) -> None:
    w = torch.randn(24, 8)
    packed = kernels.pack_linear(w)
    x = torch.randn(5, 8)
    assert torch.allclose(kernels.linear_forward(x, packed), x @ w.T, atol=1e-5)
    with pytest.raises(RuntimeError, match="shape does not match"):
        kernels.linear_forward(torch.randn(5, 9), packed)
    with pytest.raises(RuntimeError, match="int8|float32 or bfloat16"):
        kernels.linear_forward(x, kernels.PackedLinear(packed.wp.to(torch.int8), 24))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_module_kernel_equals_f_linear(kernel_isas: list[str], dtype: torch.dtype, bias: bool) -> None:
    torch.manual_seed(0)
    lin = Linear(48, 40, bias=bias, dtype=dtype).requires_grad_(False)
    x = torch.randn(2, 3, 48).to(dtype)  # any leading dims
    got = lin(x)
    assert lin.packed_weight(x) is not None and got.shape == (2, 3, 40) and got.dtype == dtype
    want = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert (got.double() - want).abs().max().item() < tol * want.abs().max().item()
    lin.use_kernel = False
    assert lin.packed_weight(x) is None
    assert (lin(x).double() - got.double()).abs().max().item() < tol * want.abs().max().item()
    # the state dict is nn.Linear's
    assert set(lin.state_dict()) == ({"weight", "bias"} if bias else {"weight"})


def test_linear_module_repacks_after_in_place_writes_and_tp_slicing(kernel_isas: list[str]) -> None:
    lin = Linear(32, 64, bias=True).requires_grad_(False)
    x = torch.randn(3, 32)
    first = lin(x)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # a reload / migration writes in place
    assert torch.allclose(lin(x), F.linear(x, lin.weight, lin.bias), atol=1e-5)
    assert not torch.allclose(lin(x), first)
    shard_linear_(lin, out_slice=slice(16, 48))  # column-parallel TP shard: a new, smaller weight
    got = lin(x)
    assert got.shape == (3, 32) and torch.allclose(got, F.linear(x, lin.weight, lin.bias), atol=1e-5)
    shard_linear_(lin, in_slice=slice(0, 16))  # then row-parallel: the input shrinks
    x16 = torch.randn(3, 16)
    assert torch.allclose(lin(x16), F.linear(x16, lin.weight, lin.bias), atol=1e-5)


def test_linear_module_leaves_autograd_and_library_sizes_to_pytorch(kernel_isas: list[str]) -> None:
    lin = Linear(16, 8)  # weight requires grad
    x = torch.randn(4, 16, requires_grad=True)
    assert lin.packed_weight(x) is None
    lin(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None
    lin.requires_grad_(False)
    assert lin.packed_weight(torch.randn(4, 16)) is not None
    # fp32 prefill-size row counts: MKL's GEMM is the faster choice (kernels.prefers_library_gemm)
    assert lin.packed_weight(torch.randn(kernels.LIBRARY_GEMM_MIN_ROWS, 16)) is None


def _mla(dtype: torch.dtype) -> MLAAttention:
    cfg = ModelConfig.from_hf(dict(
        architectures=["DeepseekV3ForCausalLM"], vocab_size=32, hidden_size=32, num_hidden_layers=1,
        num_attention_heads=4, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=24, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=12, q_lora_rank=None, first_k_dense_replace=0))
    torch.manual_seed(3)
    attn = MLAAttention(cfg, dtype=dtype)
    for p in attn.parameters():
        p.data.copy_(torch.randn_like(p, dtype=torch.float32).to(dtype) * 0.3)
    return attn


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_mla_absorbed_products_on_the_kernel_equal_the_einsums(kernel_isas: list[str], dtype: torch.dtype,
                                                               tol: float) -> None:
    attn = _mla(dtype)
    b, h, lq, length = 3, 4, 1, 9
    q = torch.randn(b, h, lq, 8 + 4).to(dtype)  # [B, H, Lq, Nn + R]
    latent = torch.randn(b, length, 24 + 4).to(dtype)  # [B, L, C + R]
    mask = torch.ones(b, 1, lq, length, dtype=torch.bool)
    mask[0, ..., 5:] = False
    assert attn._absorbed_packed(q) is not None
    got = attn._attend_absorbed(q, latent, mask)
    assert got.shape == (b, h, lq, 12) and got.dtype == dtype
    attn.kv_b_proj.use_kernel = False  # the einsum path
    assert attn._absorbed_packed(q) is None
    want = attn._attend_absorbed(q, latent, mask)
    assert (got.float() - want.float()).abs().max().item() < tol * want.float().abs().max().item()
    naive = attn._attend_naive(q, latent, mask)
    assert (got.float() - naive.float()).abs().max().item() < 3 * tol * naive.float().abs().max().item()


def test_bf16_attention_products_upcast_where_bf16_gemms_are_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 16, generator=gen).to(torch.bfloat16)  # [B, H, Lq, dk]
    k = torch.randn(2, 2, 7, 16, generator=gen).to(torch.bfloat16)  # [B, Hk, L, dk]
    v = torch.randn(2, 2, 7, 8, generator=gen).to(torch.bfloat16)
    mask = torch.ones(2, 1, 3, 7, dtype=torch.bool)
    monkeypatch.setattr(paged_mod, "has_fast_bf16_gemm", lambda: False)
    upcast = paged_mod.sdpa(q, k, v, mask, 0.25)
    monkeypatch.setattr(paged_mod, "has_fast_bf16_gemm", lambda: True)
    native = paged_mod.sdpa(q, k, v, mask, 0.25)
    assert upcast.shape == native.shape == (2, 4, 3, 8) and upcast.dtype == torch.bfloat16
    # same math, rounded to bf16 at the same points: within a couple of bf16 ulps
    assert (upcast.float() - native.float()).abs().max().item() <= 2 ** -6 * native.float().abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_blocks_unpack_to_the_weight(dtype: torch.dtype) -> None:
    """The block layout ([K][16]; bf16 in k pairs, [K/2][16][2]) holds each weight once, where the
    kernel reads it: unpacking gives the weight back, and bf16 pairs sit side by side in memory."""
    w = torch.randn(2, 40, 24).to(dtype)  # [G, C, K], C padded to 48
    wp = kernels.pack_linear(w).wp  # [G, 3, K, 16]
    back = kernels.unpack_blocks(wp).reshape(2, 48, 24)  # [G, Cp, K]
    assert torch.equal(back[:, :40], w) and not back[:, 40:].any()
    flat = wp.reshape(-1)
    if dtype == torch.bfloat16:  # block 0 of group 0: channel 0's k = 0, 1, then channel 1's k = 0, 1
        assert torch.equal(flat[:4], torch.stack([w[0, 0, 0], w[0, 0, 1], w[0, 1, 0], w[0, 1, 1]]))
    else:
        assert torch.equal(flat[:2], torch.stack([w[0, 0, 0], w[0, 1, 0]]))


def test_bf16_weight_with_odd_in_features_is_not_packed() -> None:
    """bf16 blocks hold k pairs: an odd K stays on PyTorch's GEMM (fp32 packs any K)."""
    w = torch.randn(16, 7)
    assert kernels.can_pack_linear(w) and not kernels.can_pack_linear(w.bfloat16())
    assert kernels.pack_linear(w).wp.shape == (1, 1, 7, 16)
    with pytest.raises(ValueError, match="in_features must be even, got 7"):
        kernels.pack_linear(w.bfloat16())
