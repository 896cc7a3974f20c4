"""Grouped expert computation against a per-token, per-assignment loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe.experts import Experts, compute_local_routing, count_ids, grouped_expert_forward


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


def test_library_grouped_mm_path_equals_the_per_slot_loop(monkeypatch) -> None:
    """The grouped-GEMM path CUDA takes for bf16 experts (``library_grouped_mm``), run here on
    PyTorch's CPU grouped GEMM: the per-slot loop's values within bf16 rounding, with empty slots,
    row weights and a slot holding one row; and it stays off where its kernels do not apply."""
    from moe import experts as experts_mod

    e = _experts(6, 32, 16, torch.bfloat16, seed=4)
    gen = torch.Generator().manual_seed(5)
    counts = [7, 0, 1, 12, 0, 20]
    x = torch.randn(sum(counts), 32, generator=gen).bfloat16()
    rw = torch.rand(sum(counts), generator=gen)
    assert experts_mod.library_grouped_mm(x, e.w13, e.w2) is None  # CPU: the loop (and the fused kernel)
    fn = experts_mod.library_grouped_mm(x, e.w13, e.w2, device_types=("cpu",))
    assert fn is not None
    for bad in (x.float(), x[:, :30].contiguous(), x[:0]):  # fp32, a 60-byte row, no rows
        assert experts_mod.library_grouped_mm(bad, e.w13, e.w2, device_types=("cpu",)) is None
    loop = grouped_expert_forward(x, counts, e.w13, e.w2, row_weights=rw)
    calls: list[int] = []
    original = experts_mod.library_grouped_mm

    def gate(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs, device_types=("cpu",))

    monkeypatch.setattr(experts_mod, "library_grouped_mm", gate)
    grouped = grouped_expert_forward(x, counts, e.w13, e.w2, row_weights=rw)
    assert calls == [1] and grouped.shape == (40, 32) and grouped.dtype == torch.bfloat16
    want = _naive(x, torch.repeat_interleave(torch.arange(6), torch.tensor(counts))[:, None], rw[:, None],
                  e.w13, e.w2).float()
    scale = want.abs().max()
    assert (grouped.float() - want).abs().max() <= 2e-2 * scale
    assert (grouped.float() - loop.float()).abs().max() <= 2e-2 * scale


def test_grouped_gemm_forward_equals_the_loop_with_dropped_rows(monkeypatch) -> None:
    """``Experts.forward``'s sync-free path on the grouped GEMM (CUDA's, run here on PyTorch's CPU one):
    the per-slot loop's values within bf16 rounding, dropped assignments (-1) adding nothing even
    when the GEMM leaves their rows as NaN, an unused slot, and the same bits on a second call."""
    from moe import experts as experts_mod

    e = _experts(5, 32, 16, torch.bfloat16, seed=6)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(50, 32, generator=gen).bfloat16()
    ids = torch.randint(-1, 4, (50, 3), generator=gen)  # slot 4 never used, some dropped
    w = torch.rand(50, 3, generator=gen)
    e.use_kernel = False
    loop = e(x, ids, w)  # [T, D] float32, the per-slot loop
    original = experts_mod.library_grouped_mm
    calls: list[int] = []

    def poisoning(x, w, offs):  # rows past the last group's end hold NaN, as uninitialised memory may
        calls.append(1)
        out = torch._grouped_mm(x, w, offs=offs)
        out[int(offs[-1]):] = float("nan")
        return out

    def gate(x, w13, w2, **kwargs):
        return poisoning if original(x, w13, w2, device_types=("cpu",)) is not None else None

    monkeypatch.setattr(experts_mod, "library_grouped_mm", gate)
    e.use_kernel = True
    e.fused_topk = False  # not the CPU kernel: the path CUDA takes
    e._packed = None
    monkeypatch.setattr(experts_mod.kernels, "can_pack", lambda *a: False)
    out = e(x, ids, w)
    assert len(calls) == 2 and out.shape == (50, 32) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    want = _naive(x, ids, w, e.w13, e.w2).float()
    scale = want.abs().max()
    assert (out - want).abs().max() <= 2e-2 * scale and (out - loop).abs().max() <= 2e-2 * scale
    assert torch.equal(e(x, ids, w), out)
    all_dropped = e(x, torch.full((50, 3), -1), w)
    assert torch.equal(all_dropped, torch.zeros(50, 32))


def test_count_ids_counts_as_bincount_does() -> None:
    """Both ways of counting give bincount's counts; weighted occurrences count their weight (the
    padded rows of a recorded decode step weigh 0)."""
    ids = torch.tensor([3, 0, 3, 5, 3, 0], dtype=torch.int64)
    expected = torch.bincount(ids, minlength=7)
    for sync_free in (False, True):
        counts = count_ids(ids, 7, sync_free=sync_free)
        assert counts.dtype == torch.int64 and counts.tolist() == expected.tolist()
        weighted = count_ids(ids, 7, weights=torch.tensor([1, 1, 0, 1, 2, 0]), sync_free=sync_free)
        assert weighted.dtype == torch.int64 and weighted.tolist() == [1, 0, 0, 3, 0, 1, 0]
