"""RMSNorm as one CPU op (moe.kernels.rms_norm), and the residual add fused into it (add_rms_norm),
against the PyTorch expressions they replace."""

from __future__ import annotations

import pytest
import torch

from moe import kernels
from moe.layers.norm import RMSNorm


def _norm(dim: int, dtype: torch.dtype, seed: int = 0) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6, dtype)
    norm.weight.data = torch.randn(dim, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return norm


@pytest.mark.parametrize("shape", [(1, 1024), (37, 1024), (5, 19), (2, 3, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel_equals_the_pytorch_expression(kernel_isas: list[str], shape: tuple[int, ...],
                                                       dtype: torch.dtype) -> None:
    norm = _norm(shape[-1], dtype)
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    norm.use_kernel = False
    want = norm(x)
    norm.use_kernel = True
    assert norm._kernel_applies(x)
    for name in kernel_isas:
        kernels.select_isa(name)
        got = norm(x)
        assert got.shape == x.shape and got.dtype == dtype
        # the sum of squares in another order: fp32 within a few ulps; bf16 rounds the same
        # except where the fp32 value sits on a rounding boundary (one bf16 ulp)
        tol = 1e-6 if dtype == torch.float32 else 2 ** -7
        assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item(), name
    kernels.select_isa("auto")


def test_rms_norm_kernel_splits_rows_over_threads_without_changing_them(kernel_isas: list[str]) -> None:
    norm = _norm(64, torch.float32)
    x = torch.randn(4096, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = norm(x)
        torch.set_num_threads(2)
        two = norm(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_rms_norm_falls_back_where_the_kernel_does_not_apply(kernel_isas: list[str]) -> None:
    norm = _norm(16, torch.float32)
    assert not norm._kernel_applies(torch.randn(2, 16).to(torch.bfloat16))  # x not in the weight's dtype
    x = torch.randn(2, 16, requires_grad=True)
    assert not norm._kernel_applies(x)  # training: the kernel has no backward
    norm(x).sum().backward()
    assert x.grad is not None and x.grad.shape == (2, 16)


def test_rms_norm_op_rejects_mismatched_inputs(kernel_isas: list[str]) -> None:
    with pytest.raises(RuntimeError, match="weight \\[D\\]"):
        kernels.rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="both be float32 or both bfloat16"):
        kernels.rms_norm(torch.zeros(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-6)


def _ties_and_edges(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose sums sit on bf16 rounding ties (half an ulp above 1 and above 1 + 2^-7: the tie goes
    to the even neighbour, down then up), overflow to inf, and subnormals."""
    h = torch.tensor([[1.0, 1.0 + 2 ** -7, 3e38, 1e-39, -2.5, 0.0, 1.0, -1.0]] * 2)
    r = torch.tensor([[2 ** -8, 2 ** -8, 3e38, 1e-39, 2.5, -0.0, -1.0, 2 ** -9]] * 2)
    return h.to(dtype), r.to(dtype)


@pytest.mark.parametrize("shape", [(1, 1024), (37, 1024), (5, 19)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_add_then_the_norm_bit_for_bit(kernel_isas: list[str], shape: tuple[int, int],
                                                           dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    h, r = (torch.randn(*shape, generator=g) * 4).to(dtype), torch.randn(*shape, generator=g).to(dtype)
    weight = _norm(shape[-1], dtype).weight
    for name in kernel_isas:
        kernels.select_isa(name)
        s, y = kernels.add_rms_norm(h, r, weight, 1e-6)
        assert s.shape == y.shape == shape and s.dtype == y.dtype == dtype
        assert torch.equal(s, h + r), name
        assert torch.equal(y, kernels.rms_norm(h + r, weight, 1e-6)), name
    kernels.select_isa("auto")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_rounds_the_sum_as_pytorch_does(kernel_isas: list[str], dtype: torch.dtype) -> None:
    h, r = _ties_and_edges(dtype)
    weight = torch.ones(h.shape[1], dtype=dtype)
    want = h + r
    if dtype == torch.bfloat16:  # the ties went to the even neighbour: down from 1, up from 1 + 2^-7
        assert want[0, 0].item() == 1.0 and want[0, 1].item() == 1.0 + 2 ** -6
    for name in kernel_isas:
        kernels.select_isa(name)
        s, _ = kernels.add_rms_norm(h, r, weight, 1e-6)
        assert torch.equal(s, want), name
    kernels.select_isa("auto")


def test_fused_add_op_is_the_add_then_the_module_where_the_kernel_does_not_apply(kernel_isas: list[str]) -> None:
    norm = _norm(16, torch.float32)
    h, r = torch.randn(3, 16), torch.randn(3, 16)
    for use_kernel in (True, False):
        norm.use_kernel = use_kernel
        s, y = norm.fused_add_op(h)(h, r)
        assert torch.equal(s, h + r) and torch.equal(y, norm(h + r)), use_kernel
    x = torch.randn(3, 16, requires_grad=True)  # autograd: the add and the module, so gradients flow
    s, y = norm.fused_add_op(x)(x, r)
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == (3, 16)


def test_add_rms_norm_op_rejects_mismatched_inputs(kernel_isas: list[str]) -> None:
    with pytest.raises(RuntimeError, match="r \\[T, D\\]"):
        kernels.add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="all be float32 or all bfloat16"):
        kernels.add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-6)
