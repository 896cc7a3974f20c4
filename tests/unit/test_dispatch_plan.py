"""Pure parts of the AllToAll dispatcher: dedup plan, wire format, split sizes, builder checks."""

from __future__ import annotations

import pytest
import torch

from moe.dispatch import LocalDispatcher
from parallel.dispatch import build_dispatcher
from parallel.dispatch.plan import compute_dispatch_plan, pack_rows, row_layout, split_sizes, unpack_rows
from parallel.layout import Layout


def test_plan_sends_each_token_once_per_rank() -> None:
    # 2 ranks x 2 local slots: slots 0,1 on rank 0; 2,3 on rank 1
    ids = torch.tensor([[0, 1, 3], [2, -1, 3], [1, 0, -1]])
    w = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.9, 0.4], [0.7, 0.3, 0.1]])
    plan = compute_dispatch_plan(ids, w, num_local_slots=2, num_ranks=2)
    assert plan.send_counts == [2, 2]
    assert plan.pair_token.tolist() == [0, 2, 0, 1]  # rank 0: t0, t2; rank 1: t0, t1
    assert plan.local_slots.shape == (4, 3) and plan.weights.shape == (4, 3)
    assert plan.local_slots.tolist() == [[0, 1, -1], [1, 0, -1], [-1, -1, 1], [0, -1, 1]]
    assert torch.equal(plan.weights, torch.tensor(
        [[0.5, 0.3, 0.0], [0.7, 0.3, 0.0], [0.0, 0.0, 0.2], [0.6, 0.0, 0.4]]))


def test_plan_empty_and_out_of_range() -> None:
    plan = compute_dispatch_plan(torch.empty(0, 2, dtype=torch.int64), torch.empty(0, 2), 3, 4)
    assert plan.send_counts == [0, 0, 0, 0] and plan.pair_token.numel() == 0
    with pytest.raises(ValueError, match="slot id 8 out of range: 2 ranks x 4 local slots"):
        compute_dispatch_plan(torch.tensor([[8]]), torch.ones(1, 1), 4, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_unpack_roundtrip(dtype: torch.dtype) -> None:
    x = torch.randn(4, 7).to(dtype)
    ids = torch.tensor([[0, 3], [1, 2], [3, -1], [2, 0]])
    w = torch.rand(4, 2)
    plan = compute_dispatch_plan(ids, w, 2, 2)
    buf = pack_rows(x, plan)
    hidden_bytes, row_bytes = row_layout(7, 2, dtype)
    assert hidden_bytes % 8 == 0 and buf.shape == (plan.pair_token.numel(), row_bytes)
    rx, rslots, rw = unpack_rows(buf, 7, 2, dtype)
    assert torch.equal(rx, x[plan.pair_token])
    assert torch.equal(rslots, plan.local_slots) and torch.equal(rw, plan.weights)


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
