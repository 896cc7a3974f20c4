"""Pure parts of the AllToAll dispatcher: dedup plan, wire format, split sizes, builder checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe.dispatch import LocalDispatcher
from parallel.dispatch import build_dispatcher
from parallel.dispatch.plan import (
    combine_rows,
    compute_dispatch_plan,
    localize_slots,
    pack_rows,
    row_layout,
    split_sizes,
    unpack_rows,
)
from parallel.layout import Layout


def test_plan_sends_each_token_once_per_rank() -> None:
    # 2 ranks x 2 local slots: slots 0,1 on rank 0; 2,3 on rank 1
    ids = torch.tensor([[0, 1, 3], [2, -1, 3], [1, 0, -1]])
    plan = compute_dispatch_plan(ids, num_local_slots=2, num_ranks=2)
    assert plan.send_counts == [2, 2] and plan.num_rows == 4
    assert plan.pair_token.tolist() == [0, 2, 0, 1]  # rank 0: t0, t2; rank 1: t0, t1
    # token-major: t0's rows (0 on rank 0, 2 on rank 1), t1's row 3, t2's row 1
    assert plan.combine_index.tolist() == [0, 2, 3, 1]
    assert plan.combine_offsets.tolist() == [0, 2, 3]


def test_plan_empty_and_out_of_range() -> None:
    plan = compute_dispatch_plan(torch.empty(0, 2, dtype=torch.int64), 3, 4)
    assert plan.send_counts == [0, 0, 0, 0] and plan.pair_token.numel() == 0
    assert plan.combine_offsets.shape == (0,)
    dropped = compute_dispatch_plan(torch.full((3, 2), -1), 2, 2)
    assert dropped.send_counts == [0, 0] and dropped.combine_offsets.tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="slot id 8 out of range: 2 ranks x 4 local slots"):
        compute_dispatch_plan(torch.tensor([[8]]), 4, 2)
    with pytest.raises(ValueError, match="slot id -3 out of range"):
        compute_dispatch_plan(torch.tensor([[-3, 1]]), 4, 2)


@given(
    tokens=st.integers(0, 40), top_k=st.integers(1, 6), num_ranks=st.integers(1, 5),
    num_local=st.integers(1, 4), seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=60, deadline=None)
def test_plan_and_combine_match_a_per_token_loop(
    tokens: int, top_k: int, num_ranks: int, num_local: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, num_ranks * num_local, (tokens, top_k), generator=gen)
    plan = compute_dispatch_plan(ids, num_local, num_ranks)
    want = [(r, t) for r in range(num_ranks) for t in range(tokens)
            if any(int(s) >= 0 and int(s) // num_local == r for s in ids[t])]
    assert plan.pair_token.tolist() == [t for _, t in want]
    assert plan.send_counts == [sum(1 for r, _ in want if r == rank) for rank in range(num_ranks)]
    back = torch.randn(plan.num_rows, 3, generator=gen)
    out = combine_rows(back, plan)
    assert out.shape == (tokens, 3) and out.dtype == torch.float32
    expect = torch.zeros(tokens, 3).index_add_(0, plan.pair_token, back)
    torch.testing.assert_close(out, expect, atol=1e-6, rtol=1e-6)


def test_combine_bf16_accumulates_in_fp32() -> None:
    ids = torch.tensor([[0, 2, 4, 6]] * 64 + [[-1, -1, -1, -1]])  # 4 ranks, every token everywhere but the last
    plan = compute_dispatch_plan(ids, 2, 4)
    back = (torch.randn(plan.num_rows, 16) * 100).to(torch.bfloat16)
    out = combine_rows(back, plan)
    assert out.shape == (65, 16) and out.dtype == torch.float32
    exact = torch.zeros(65, 16, dtype=torch.float64).index_add_(0, plan.pair_token, back.double())
    assert torch.equal(out[64], torch.zeros(16))
    # one rounding of the exact sum to bf16 (half an ulp), not a bf16 running sum
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().clamp_min(1e-30)
    assert bool(((out.double() - exact).abs() <= ulp * 0.5 + 1e-12).all())
    with pytest.raises(ValueError, match="combine got 3 rows for a plan of 256"):
        combine_rows(back[:3], plan)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_unpack_roundtrip(dtype: torch.dtype) -> None:
    x = torch.randn(4, 7).to(dtype)
    ids = torch.tensor([[0, 3], [1, 2], [3, -1], [2, 0]])
    w = torch.rand(4, 2)
    plan = compute_dispatch_plan(ids, 2, 2)
    buf = pack_rows(x, ids, w, plan)
    hidden_bytes, row_bytes = row_layout(7, 2, dtype)
    assert hidden_bytes % 8 == 0 and buf.shape == (plan.pair_token.numel(), row_bytes)
    rx, rslots, rw = unpack_rows(buf, 7, 2, dtype)
    assert torch.equal(rx, x[plan.pair_token])
    assert torch.equal(rslots, ids[plan.pair_token].to(torch.int32)) and torch.equal(rw, w[plan.pair_token])
    with pytest.raises(ValueError, match="pack_rows out must be"):
        pack_rows(x, ids, w, plan, torch.empty(1, row_bytes, dtype=torch.uint8))


def test_localize_slots_keeps_this_ranks_columns() -> None:
    slots = torch.tensor([[0, 3, 5], [-1, 4, 2]], dtype=torch.int32)
    local = localize_slots(slots, rank=1, num_local_slots=2)  # rank 1 hosts slots 2, 3
    assert local.dtype == torch.int64 and local.shape == (2, 3)
    assert local.tolist() == [[-1, 1, -1], [-1, -1, 0]]


def test_split_sizes() -> None:
    assert split_sizes(7, 2) == [4, 3]
    assert split_sizes(1, 4) == [1, 0, 0, 0]
    assert split_sizes(0, 2) == [0, 0]
    assert [t.shape[0] for t in torch.arange(10).tensor_split(4)] == split_sizes(10, 4)


def test_build_dispatcher_validates() -> None:
    assert isinstance(build_dispatcher("local", None, Layout()), LocalDispatcher)
    with pytest.raises(ValueError, match="unknown dispatcher backend 'nccl'"):
        build_dispatcher("nccl", None, Layout())
    with pytest.raises(ValueError, match="needs ep=1"):
        build_dispatcher("local", None, Layout(dp=2))
    with pytest.raises(ValueError, match="needs ProcessGroups"):
        build_dispatcher("alltoall", None, Layout(dp=2))


@given(
    tokens=st.integers(0, 40), top_k=st.integers(1, 6), num_ranks=st.integers(1, 5),
    num_local=st.integers(1, 4), hidden=st.integers(1, 40), bf16=st.booleans(), int32=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
@settings(max_examples=60, deadline=None)
def test_the_cpu_op_plans_and_packs_as_the_tensor_ops_do(
    kernel_isas: list[str], tokens: int, top_k: int, num_ranks: int, num_local: int, hidden: int, bf16: bool,
    int32: bool, seed: int,
) -> None:
    """``moe.kernels.dispatch_plan`` (the AllToAll dispatcher's CPU path): the plan's rows, counts,
    combine order and offsets, and every byte of the packed rows but the hidden vector's padding."""
    from moe import kernels

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16 if bf16 else torch.float32)
    ids = torch.randint(-1, num_ranks * num_local, (tokens, top_k), generator=gen)
    ids = ids.to(torch.int32) if int32 else ids
    weights = torch.rand(tokens, top_k, generator=gen)
    space = torch.empty(tokens * min(top_k, num_ranks), row_layout(hidden, top_k, x.dtype)[1], dtype=torch.uint8)
    send, pair_token, counts, combine_index, combine_offsets = kernels.dispatch_plan(x, ids, weights, num_local,
                                                                                     num_ranks, space)
    plan = compute_dispatch_plan(ids, num_local, num_ranks)
    want = pack_rows(x, ids, weights, plan)
    assert send.shape == want.shape == (plan.num_rows, row_layout(hidden, top_k, x.dtype)[1])
    assert plan.num_rows == 0 or send.data_ptr() == space.data_ptr()  # into the caller's (reused) buffer
    assert torch.equal(pair_token, plan.pair_token) and counts.tolist() == plan.send_counts
    assert torch.equal(combine_index, plan.combine_index) and torch.equal(combine_offsets, plan.combine_offsets)
    nbytes, padded = hidden * x.element_size(), row_layout(hidden, top_k, x.dtype)[0]
    assert torch.equal(send[:, :nbytes], want[:, :nbytes]) and torch.equal(send[:, padded:], want[:, padded:])


def test_the_cpu_op_names_a_slot_out_of_range_and_a_short_buffer(kernel_isas: list[str]) -> None:
    from moe import kernels

    space = torch.empty(2, row_layout(4, 2, torch.float32)[1], dtype=torch.uint8)
    with pytest.raises(ValueError, match="slot id 8 out of range: 2 ranks x 4 local slots"):
        kernels.dispatch_plan(torch.zeros(1, 4), torch.tensor([[8, 0]]), torch.ones(1, 2), 4, 2, space)
    with pytest.raises(ValueError, match="slot id -3 out of range"):
        kernels.dispatch_plan(torch.zeros(1, 4), torch.tensor([[-3, 1]]), torch.ones(1, 2), 4, 2, space)
    with pytest.raises(RuntimeError, match=r"send buffer must be \[>= 2, 32\] uint8"):
        kernels.dispatch_plan(torch.zeros(1, 4), torch.tensor([[0, 5]]), torch.ones(1, 2), 4, 2, space[:1])
