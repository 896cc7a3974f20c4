"""Grouped expert computation against a per-token, per-assignment loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe.experts import Experts, compute_local_routing, grouped_expert_forward


def _naive(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    inter = w2.shape[-1]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            s = int(ids[t, k])
            if s < 0:
                continue
            h = x[t].double() @ w13[s].double().t()
            y = (F.silu(h[:inter]) * h[inter:]) @ w2[s].double().t()
            out[t] += float(w[t, k]) * y
    return out


def _experts(num_slots: int, hidden: int, inter: int, dtype: torch.dtype, seed: int) -> Experts:
    gen = torch.Generator().manual_seed(seed)
    e = Experts(num_slots, hidden, inter, dtype=dtype)
    e.w13.data.copy_(torch.randn(e.w13.shape, generator=gen) * 0.3)
    e.w2.data.copy_(torch.randn(e.w2.shape, generator=gen) * 0.3)
    return e


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_forward_matches_naive_loop(dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(0)
    experts = _experts(5, 12, 7, dtype, seed=1)
    x = torch.randn(2100, 12, generator=gen).to(dtype)  # > one accumulation chunk
    ids = torch.randint(-1, 4, (2100, 3), generator=gen)  # slot 4 never used, some -1
    w = torch.rand(2100, 3, generator=gen)
    out = experts(x, ids, w)
    assert out.shape == (2100, 12) and out.dtype == torch.float32
    want = _naive(x[:300], ids[:300], w[:300], experts.w13, experts.w2).float()
    torch.testing.assert_close(out[:300], want, atol=tol, rtol=tol)
    # tokens beyond the first chunk too
    want_tail = _naive(x[-50:], ids[-50:], w[-50:], experts.w13, experts.w2).float()
    torch.testing.assert_close(out[-50:], want_tail, atol=tol, rtol=tol)


def test_row_weights_scale_rows() -> None:
    experts = _experts(3, 8, 4, torch.float32, seed=2)
    x = torch.randn(6, 8)
    counts = [2, 0, 4]
    rw = torch.tensor([0.5, 2.0, 1.0, -1.0, 0.0, 3.0])
    plain = grouped_expert_forward(x, counts, experts.w13, experts.w2)
    scaled = grouped_expert_forward(x, counts, experts.w13, experts.w2, row_weights=rw)
    assert scaled.shape == (6, 8)
    torch.testing.assert_close(scaled, plain * rw[:, None], atol=1e-6, rtol=1e-5)


def test_no_assignments_and_routing_groups() -> None:
    experts = _experts(2, 4, 3, torch.float32, seed=3)
    out = experts(torch.randn(3, 4), torch.full((3, 2), -1), torch.ones(3, 2))
    assert torch.equal(out, torch.zeros(3, 4))
    order, token_of_row, counts = compute_local_routing(torch.tensor([[1, 0], [1, -1]]), 2)
    assert counts == [1, 2] and token_of_row.tolist() == [0, 0, 1] and order.tolist() == [1, 0, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_rows_is_forward_in_the_wire_dtype(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    experts = _experts(4, 10, 6, dtype, seed=5)
    x = torch.randn(50, 10, generator=gen).to(dtype)
    ids = torch.randint(-1, 4, (50, 3), generator=gen)
    ids[7] = -1  # a row with nothing to compute
    w = torch.rand(50, 3, generator=gen)
    rows = experts.forward_rows(x, ids, w)
    assert rows.shape == (50, 10) and rows.dtype == dtype
    assert torch.equal(rows[7], torch.zeros(10, dtype=dtype))
    want = experts(x, ids, w)  # [T, D] float32
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    torch.testing.assert_close(rows.float(), want, **tol)
    empty = experts.forward_rows(x[:0], ids[:0], w[:0])
    assert empty.shape == (0, 10)
