"""compute_move_plan: source preference, determinism, matching sends and receives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from balancer import compute_move_plan, rebalance_experts


def test_identical_placements_need_nothing():
    phy = torch.tensor([[0, 1, 2, 3]])
    plan = compute_move_plan(phy, phy, 2, 1, 100)
    assert plan.is_empty and plan.total_bytes == 0 and plan.num_copies_moved == 0


def test_local_copy_preferred_over_transfer():
    # 2 GPUs x 2 slots. Expert 0 already on GPU 0 (slot 0) -> slot 1 is a local copy.
    old = torch.tensor([[0, 1, 2, 3]])
    new = torch.tensor([[0, 0, 2, 1]])
    plan = compute_move_plan(old, new, 2, 2, 10)
    assert [(t.src_slot, t.dst_slot) for t in plan.local_copies] == [(0, 1)]
    assert [(t.expert, t.src_rank, t.dst_rank, t.dst_slot) for t in plan.transfers] == [(1, 0, 1, 3)]
    assert plan.total_bytes == 10 and plan.num_copies_moved == 1


def test_same_node_source_preferred_and_sends_spread():
    # 4 GPUs x 1 slot, 2 per node. Expert 0 on GPUs 0 and 2; GPU 3 (node 1) takes it from GPU 2.
    old = torch.tensor([[0, 1, 0, 2]])
    new = torch.tensor([[0, 1, 0, 0]])
    plan = compute_move_plan(old, new, 4, 2, 1)
    assert [(t.src_rank, t.dst_rank) for t in plan.transfers] == [(2, 3)]
    assert plan.cross_node_bytes == 0
    # Two receivers on another node: the two replicas of expert 0 share the sends.
    old = torch.tensor([[0, 0, 1, 2]])
    new = torch.tensor([[0, 0, 0, 0]])
    plan = compute_move_plan(old, new, 4, 2, 1)
    assert sorted(t.src_slot for t in plan.transfers) == [0, 1]
    assert plan.cross_node_bytes == 2


def test_plan_is_deterministic_and_sends_match_receives():
    rng = np.random.default_rng(0)
    w = rng.lognormal(0, 1, size=(4, 32))
    old = rebalance_experts(w, 48, 4, 2, 8)[0]
    new = rebalance_experts(w * rng.lognormal(0, 0.5, size=w.shape), 48, 4, 2, 8)[0]
    a = compute_move_plan(old, new, 8, 4, 7)
    b = compute_move_plan(old.numpy(), new.numpy(), 8, 4, 7)
    assert a == b
    for layer in range(4):
        for src in range(8):
            for dst in range(8):
                sends = [t for t in a.sends(src, layer) if t.dst_rank == dst]
                recvs = [t for t in a.recvs(dst, layer) if t.src_rank == src]
                assert sends == recvs
        assert sum(len(a.sends(r, layer)) for r in range(8)) == sum(t.layer == layer for t in a.transfers)
        assert a.local(0, layer) == [t for t in a.local_copies if t.dst_rank == 0 and t.layer == layer]
    assert a.sends(0) == [t for t in a.transfers if t.src_rank == 0]
    # Applying the plan to the old placement yields the new one.
    result = old.clone()
    for t in a.transfers + a.local_copies:
        assert old[t.layer, t.src_slot] == t.expert
        result[t.layer, t.dst_slot] = t.expert
    assert torch.equal(result, new)
    assert a.total_bytes == 7 * a.num_copies_moved
    assert a.summary()["num_local_copies"] == len(a.local_copies)


def test_bad_inputs():
    phy = torch.tensor([[0, 1, 2, 3]])
    with pytest.raises(ValueError, match="differ in shape"):
        compute_move_plan(phy, phy[:, :2], 2, 1, 1)
    with pytest.raises(ValueError, match="split evenly"):
        compute_move_plan(phy, phy, 3, 1, 1)
    with pytest.raises(ValueError, match="gpus_per_node"):
        compute_move_plan(phy, phy, 2, 3, 1)
    with pytest.raises(ValueError, match="no copy in the old placement"):
        compute_move_plan(phy, torch.tensor([[0, 1, 2, 4]]), 2, 1, 1)
