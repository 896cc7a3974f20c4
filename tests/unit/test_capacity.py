"""Capacity enforcement: hand-checked cases, invariants, and DeepSpeed as the oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe.capacity import (
    apply_capacity,
    apply_slot_limits,
    compute_capacity,
    compute_global_limits,
    compute_slot_positions,
)


def test_compute_capacity_formula() -> None:
    assert compute_capacity(8, 4, 2, 1.0) == 4
    assert compute_capacity(10, 4, 2, 1.0) == 5
    assert compute_capacity(10, 4, 1, 1.25) == 4  # ceil(3.125)
    assert compute_capacity(3, 8, 1, 1.0, min_capacity=4) == 4
    assert compute_capacity(0, 8, 2, 1.0) == 0
    assert compute_capacity(100, 8, 2, 0.0) is None
    assert compute_capacity(100, 8, 2, -1.0) is None
    with pytest.raises(ValueError, match="num_slots"):
        compute_capacity(4, 0, 2, 1.0)


def test_position_policy_keeps_token_order() -> None:
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    w = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.5, 0.5], [0.7, 0.3]])
    # T=4, K=2, P=3, cf=0.75 -> C = ceil(4/3 * 1.5) = 2
    res = apply_capacity(ids, w, 3, 0.75)
    assert res.capacity == 2
    assert res.kept.shape == (4, 2) and res.topk_ids.shape == (4, 2) and res.topk_weights.shape == (4, 2)
    # slot 0 sees t0, t1, t2, t3 -> keeps t0, t1; slot 1 sees t0, t2, t3 -> keeps t0, t2
    expected_kept = torch.tensor([[True, True], [True, True], [False, True], [False, False]])
    assert torch.equal(res.kept, expected_kept)
    assert torch.equal(res.topk_ids, torch.tensor([[0, 1], [0, 2], [-1, 1], [-1, -1]]))
    assert torch.equal(res.topk_weights, torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.0, 0.5], [0.0, 0.0]]))
    assert res.slot_assignments.tolist() == [4, 3, 1]
    assert res.slot_dropped.tolist() == [2, 1, 0]
    assert res.slot_load.tolist() == [2, 2, 1]
    s = res.stats
    assert (s.assignments, s.dropped, s.rerouted, s.max_slot_load, s.capacity) == (8, 3, 0, 2, 2)


def test_score_policy_keeps_highest_weights_and_renormalizes() -> None:
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    w = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.5, 0.5], [0.7, 0.3]])
    res = apply_capacity(ids, w, 3, 0.75, policy="score", renormalize=True)
    # slot 0 candidates by weight: t1 0.9, t0 0.6, t2 0.5, t3 0.3 -> keep t1, t0
    # slot 1: t3 0.7, t2 0.5, t0 0.4 -> keep t3, t2
    assert torch.equal(res.topk_ids, torch.tensor([[0, -1], [0, 2], [-1, 1], [1, -1]]))
    assert torch.allclose(res.topk_weights, torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [1.0, 0.0]]))


def test_reroute_moves_to_next_best_with_room() -> None:
    ids = torch.tensor([[0, 1], [0, 1], [0, 2]])
    w = torch.tensor([[0.5, 0.5], [0.6, 0.4], [0.7, 0.3]])
    scores = torch.tensor(
        [[0.5, 0.5, 0.1, 0.0], [0.6, 0.4, 0.0, 0.3], [0.7, 0.1, 0.3, 0.2]]
    )  # T=3, P=4, K=2, cf=1 -> C = ceil(3/4*2) = 2
    res = apply_capacity(ids, w, 4, 1.0, overflow="reroute", router_scores=scores)
    assert res.capacity == 2
    # t2's slot 0 overflows; its best unused slot with room is 3 (slot 1 has room too but
    # scores 0.1 < 0.2); weight moves with it.
    assert torch.equal(res.topk_ids, torch.tensor([[0, 1], [0, 1], [3, 2]]))
    assert torch.equal(res.kept, torch.ones(3, 2, dtype=torch.bool))
    assert torch.equal(res.topk_weights, w)
    assert res.stats.rerouted == 1 and res.stats.dropped == 0
    assert res.slot_rerouted.tolist() == [1, 0, 0, 0]
    assert res.slot_load.tolist() == [2, 2, 1, 1]


def test_reroute_drops_when_no_room_and_respects_masked_slots() -> None:
    ids = torch.tensor([[0], [0], [0]])
    w = torch.ones(3, 1)
    scores = torch.tensor([[1.0, 0.5], [1.0, 0.5], [1.0, float("-inf")]])
    # T=3, P=2, K=1, cf=0.5 -> C = ceil(0.75) = 1: t1 -> slot 1, t2 cannot use slot 1
    res = apply_capacity(ids, w, 2, 0.5, overflow="reroute", router_scores=scores)
    assert res.topk_ids.tolist() == [[0], [1], [-1]]
    assert res.stats.dropped == 1 and res.stats.rerouted == 1


def test_dropless_and_pre_dropped() -> None:
    ids = torch.tensor([[0, -1], [1, 0]])
    w = torch.tensor([[0.5, 0.5], [0.2, 0.8]])
    res = apply_capacity(ids, w, 2, 0.0, renormalize=True)
    assert res.capacity is None
    assert torch.equal(res.kept, ids >= 0)
    assert torch.allclose(res.topk_weights, torch.tensor([[1.0, 0.0], [0.2, 0.8]]))
    assert res.stats.assignments == 3 and res.stats.dropped == 0


def test_empty_input() -> None:
    ids = torch.empty(0, 2, dtype=torch.int64)
    res = apply_capacity(ids, torch.empty(0, 2), 4, 1.0)
    assert res.kept.shape == (0, 2) and res.capacity == 0
    assert res.stats.max_slot_load == 0


def test_bad_inputs_raise() -> None:
    ids = torch.tensor([[0, 1]])
    w = torch.ones(1, 2)
    with pytest.raises(ValueError, match="policy"):
        apply_capacity(ids, w, 2, 1.0, policy="random")
    with pytest.raises(ValueError, match="overflow"):
        apply_capacity(ids, w, 2, 1.0, overflow="spill")
    with pytest.raises(ValueError, match="out of range"):
        apply_capacity(ids, w, 1, 1.0)
    with pytest.raises(ValueError, match="differs"):
        apply_capacity(ids, torch.ones(2, 1), 2, 1.0)
    with pytest.raises(ValueError, match="router_scores"):
        apply_capacity(ids, w, 2, 0.5, overflow="reroute")


def test_slot_positions_order() -> None:
    ids = torch.tensor([[2, 0], [0, -1], [2, 1]])
    assert compute_slot_positions(ids, 3).tolist() == [[0, 0], [1, -1], [1, 0]]
    prio = torch.tensor([[0.1, 0.2], [0.9, 0.0], [0.8, 0.5]])
    assert compute_slot_positions(ids, 3, prio).tolist() == [[1, 1], [0, -1], [0, 0]]


def test_global_limits_equal_capacity_on_concatenation() -> None:
    gen = torch.Generator().manual_seed(3)
    sizes = [5, 0, 9, 2]
    num_slots, top_k = 6, 2
    parts = [torch.stack([torch.randperm(num_slots, generator=gen)[:top_k] for _ in range(n)])
             if n else torch.empty(0, top_k, dtype=torch.int64) for n in sizes]
    weights = [torch.rand(n, top_k, generator=gen) for n in sizes]
    counts = torch.stack([torch.bincount(p.reshape(-1), minlength=num_slots) for p in parts])
    cap = compute_capacity(sum(sizes), num_slots, top_k, 0.8)
    limits = compute_global_limits(counts, cap)
    assert limits.shape == (4, num_slots)
    assert torch.all(limits.sum(0) <= cap) and torch.all(limits <= counts)
    whole = apply_capacity(torch.cat(parts), torch.cat(weights), num_slots, 0.8, renormalize=True)
    pieces = [apply_slot_limits(p, w, lim, renormalize=True) for p, w, lim in zip(parts, weights, limits)]
    assert torch.equal(torch.cat([r.topk_ids for r in pieces]), whole.topk_ids)
    assert torch.equal(torch.cat([r.topk_weights for r in pieces]), whole.topk_weights)


@settings(max_examples=60, deadline=None)
@given(
    num_tokens=st.integers(0, 40),
    num_slots=st.integers(1, 10),
    top_k=st.integers(1, 4),
    cf=st.floats(0.1, 3.0),
    min_capacity=st.integers(0, 3),
    policy=st.sampled_from(["position", "score"]),
    overflow=st.sampled_from(["drop", "reroute"]),
    seed=st.integers(0, 2**16),
)
def test_invariants(num_tokens, num_slots, top_k, cf, min_capacity, policy, overflow, seed) -> None:
    top_k = min(top_k, num_slots)
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_slots, generator=gen)
    w, ids = torch.topk(scores, top_k, dim=1)
    res = apply_capacity(ids, w, num_slots, cf, min_capacity=min_capacity, policy=policy,
                         overflow=overflow, router_scores=scores)
    cap = res.capacity
    assert torch.all(res.slot_load <= cap)
    assert torch.equal(res.kept, res.topk_ids >= 0)
    assert torch.all(res.topk_weights[~res.kept] == 0)
    s = res.stats
    assert s.assignments == num_tokens * top_k
    assert int(res.kept.sum()) == s.assignments - s.dropped == int(res.slot_load.sum())
    for row in res.topk_ids.tolist():  # a token never uses a slot twice
        live = [x for x in row if x >= 0]
        assert len(live) == len(set(live))
    if overflow == "drop":
        assert s.rerouted == 0
        # a dropped assignment's slot is full
        full = res.slot_load[ids[~res.kept]]
        assert torch.all(full == cap)


def _dense(ids: torch.Tensor, w: torch.Tensor, num_experts: int) -> torch.Tensor:
    out = torch.zeros(ids.shape[0], num_experts)
    keep = ids >= 0
    rows = torch.arange(ids.shape[0]).unsqueeze(1).expand_as(ids)[keep]
    out[rows, ids[keep]] = w[keep]
    return out


@settings(max_examples=80, deadline=None)
@given(
    num_tokens=st.integers(1, 48),
    num_experts=st.integers(2, 12),
    top_k=st.integers(1, 4),
    cf=st.one_of(st.sampled_from([0.25, 0.5, 1.0, 1.25, 2.0]), st.floats(0.05, 3.0)),
    min_capacity=st.integers(0, 4),
    policy=st.sampled_from(["position", "score"]),
    seed=st.integers(0, 2**16),
)
@pytest.mark.slow
def test_matches_deepspeed_topkgating(num_tokens, num_experts, top_k, cf, min_capacity, policy, seed) -> None:
    sharded_moe = pytest.importorskip("deepspeed.moe.sharded_moe")
    top_k = min(top_k, num_experts)
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed))
    ds_policy = "position" if policy == "position" else "probs"
    _, combine, dispatch, _ = sharded_moe.topkgating(logits, top_k, cf, min_capacity, drop_policy=ds_policy)
    gates = torch.softmax(logits, dim=1)
    top_w, top_ids = torch.topk(gates, top_k, dim=1)
    res = apply_capacity(top_ids, top_w, num_experts, cf, min_capacity=min_capacity,
                         policy=policy, renormalize=True)
    assert res.capacity == combine.shape[2]  # same C as DeepSpeed's dispatch buffer
    ds_kept = dispatch.any(dim=2)  # [T, E]
    ours = _dense(res.topk_ids, res.topk_weights, num_experts)
    assert torch.equal(ours > 0, ds_kept)
    torch.testing.assert_close(ours, combine.sum(dim=2), rtol=1e-6, atol=1e-7)
