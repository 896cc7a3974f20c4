"""Placement dataclass, log2phy construction, predict and compute_balancedness."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from balancer import Placement, compute_balancedness, compute_log2phy, predict


def test_identity_spreads_replicas_without_duplicates():
    p = Placement.identity(num_layers=3, num_experts=8, num_redundant=8, num_gpus=8)
    assert p.phy2log.shape == (3, 16) and p.log2phy.shape == (3, 8, 2) and p.logcnt.shape == (3, 8)
    assert (p.logcnt == 2).all()
    for r in range(8):
        experts = p.experts_of_rank(r)
        assert experts.shape == (3, 2)
        assert (experts[:, 0] != experts[:, 1]).all()
    assert list(p.slots_of_rank(3)) == [6, 7]
    with pytest.raises(ValueError, match="rank 8"):
        p.slots_of_rank(8)


def test_identity_rejects_uneven_split():
    with pytest.raises(ValueError, match="split evenly"):
        Placement.identity(1, 8, 1, 2)


def test_log2phy_lists_slots_ascending_and_pads():
    log2phy, logcnt = compute_log2phy(torch.tensor([[2, 0, 2, 1, 2]]), 3)
    assert log2phy.tolist() == [[[1, -1, -1], [3, -1, -1], [0, 2, 4]]]
    assert logcnt.tolist() == [[1, 1, 3]]
    with pytest.raises(ValueError, match="expert 1 of layer 0 has no physical slot"):
        compute_log2phy(torch.tensor([[0, 0, 2]]), 3)


def test_state_dict_round_trip_and_checks():
    p = Placement.from_phy2log(np.array([[0, 1, 2, 0], [2, 2, 1, 0]]), 3, 2)
    q = Placement.from_state_dict(p.state_dict())
    assert torch.equal(p.phy2log, q.phy2log) and torch.equal(p.log2phy, q.log2phy) and q.num_gpus == 2
    bad = dict(p.state_dict(), logcnt=torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="logcnt disagrees"):
        Placement.from_state_dict(bad)
    with pytest.raises(ValueError, match="lacks"):
        Placement.from_state_dict({"phy2log": p.phy2log})


def test_predict_splits_load_among_replicas():
    load = torch.tensor([[8.0, 2.0, 2.0]])
    phy2log = torch.tensor([[0, 1, 0, 2]])  # GPU0: experts 0, 1; GPU1: experts 0, 2
    pred = predict(load, phy2log, 2)
    assert pred.rank_load.shape == (1, 2) and pred.per_layer.shape == (1,)
    assert pred.rank_load.tolist() == [[6.0, 6.0]]
    assert pred.overall == pytest.approx(1.0)
    assert pred.worst_layers(1) == [(0, 1.0)]


def test_compute_balancedness_handles_idle_layers():
    per_layer, overall = compute_balancedness(torch.tensor([[0.0, 0.0], [1.0, 3.0]]))
    assert per_layer.tolist() == pytest.approx([1.0, 2 / 3]) and overall == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="dimensions"):
        compute_balancedness(torch.zeros(3))
