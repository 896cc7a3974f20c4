"""RoutingStats window, logical load, balancedness, diagnostics, all-reduce hand-off."""

from __future__ import annotations

import time

import pytest
import torch

from balancer import RoutingStats


def test_window_keeps_only_the_last_steps():
    stats = RoutingStats(num_layers=2, num_slots=4, num_ranks=2, window_size=3)
    for step in range(5):
        stats.record(torch.full((2, 4), step, dtype=torch.int64))
    assert stats.num_steps == 5 and stats.num_recorded == 3 and stats.is_full
    window = stats.local_window()
    assert window.shape == (2, 4) and window.dtype == torch.int64
    assert (window == 2 + 3 + 4).all()


def test_logical_load_sums_replicas():
    stats = RoutingStats(1, 4, 2, 10)
    stats.record(torch.tensor([[5, 1, 2, 7]]))
    phy2log = torch.tensor([[0, 1, 0, 2]])
    load = stats.logical_load(phy2log)
    assert load.shape == (1, 3)
    assert load.tolist() == [[7, 1, 7]]


def test_balancedness_per_layer_and_overall():
    stats = RoutingStats(2, 4, 2, 10)
    stats.record(torch.tensor([[1, 1, 1, 1], [3, 3, 1, 1]]))
    per_layer, overall = stats.balancedness()
    assert per_layer.shape == (2,)
    # rank loads: layer 0 [2, 2], layer 1 [6, 2]
    assert per_layer.tolist() == pytest.approx([1.0, 4 / 6])
    assert overall == pytest.approx((2 + 4) / (2 + 6))


def test_global_window_replaces_local_until_next_record():
    stats = RoutingStats(1, 2, 2, 10)
    stats.record(torch.tensor([[1, 0]]))
    sent = stats.allreduce_tensor()
    assert sent.shape == (1, 2) and sent.is_contiguous()
    stats.set_global(sent * 4)
    assert stats.window_load().tolist() == [[4, 0]]
    stats.record(torch.tensor([[0, 1]]))
    assert stats.window_load().tolist() == [[1, 1]]
    with pytest.raises(ValueError, match="reduced window has shape"):
        stats.set_global(torch.zeros(2, 2))


def test_diagnostics_name_hottest_experts_and_worst_layers():
    stats = RoutingStats(3, 4, 2, 10)
    stats.record(torch.tensor([[1, 1, 1, 1], [9, 1, 1, 1], [2, 2, 1, 1]]))
    report = stats.diagnostics(torch.tensor([[0, 1, 2, 3]] * 3), top_k=2)
    d = report.to_dict()
    assert [x["layer"] for x in d["worst_layers"]] == [1, 2]
    assert d["hottest_experts"][0] == {"layer": 1, "expert": 0, "share": 0.75, "tokens": 9}
    text = report.to_text()
    assert "layer   1" in text and "expert    0" in text and "75.0%" in text


def test_reset_and_shape_errors():
    stats = RoutingStats(1, 2, 1, 4)
    stats.record(torch.tensor([[3, 3]]))
    stats.reset()
    assert stats.num_steps == 0 and stats.local_window().sum() == 0
    with pytest.raises(ValueError, match="expected"):
        stats.record(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="split evenly"):
        RoutingStats(1, 3, 2, 4)
    with pytest.raises(ValueError, match="window_size=0"):
        RoutingStats(1, 2, 1, 0)


def test_record_costs_microseconds():
    # DeepSeek-V3 shape: 58 layers x 288 slots; a decode step takes tens of ms, 2% of that is far above this.
    stats = RoutingStats(58, 288, 32, 1000)
    load = torch.randint(0, 100, (58, 288))
    for _ in range(50):
        stats.record(load)
    start = time.perf_counter()
    n = 500
    for _ in range(n):
        stats.record(load)
    per_call = (time.perf_counter() - start) / n
    assert per_call < 500e-6, f"record() took {per_call * 1e6:.1f} us"


@pytest.mark.parametrize("batches", [[2, 3], [7], [1, 0, 9, 2], [3, 3, 3]])
def test_record_many_equals_recording_step_by_step(batches):
    """Batches of K steps (K under, at and over the window of 4, and empty) leave the window, its
    sum and the step count exactly as K calls of record do."""
    gen = torch.Generator().manual_seed(1)
    one, many = RoutingStats(2, 6, 2, 4), RoutingStats(2, 6, 2, 4)
    for k in batches:
        loads = torch.randint(0, 50, (k, 2, 6), generator=gen)
        for load in loads:
            one.record(load)
        many.record_many(loads)
        assert many.num_steps == one.num_steps and many.num_recorded == one.num_recorded
        assert torch.equal(many.local_window(), one.local_window())
        assert torch.equal(many.local_window(), many._buffer.sum(0))  # the running sum is the window's
    with pytest.raises(ValueError, match=r"expected \[K, 2, 6\]"):
        many.record_many(torch.zeros(2, 6, dtype=torch.int64))
