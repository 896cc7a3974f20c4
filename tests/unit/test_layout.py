"""Layout arithmetic: coordinates, groups, slot ownership and validation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel.layout import Layout


def test_default_ep_spans_world() -> None:
    layout = Layout(tp=2, dp=2)
    assert layout.world_size == 4 and layout.ep_size == 4 and layout.num_ep_groups == 1
    assert layout.tp_groups() == [[0, 1], [2, 3]]
    assert layout.dp_groups() == [[0, 2], [1, 3]]
    assert layout.ep_groups() == [[0, 1, 2, 3]]


def test_coords_node_major_tp_innermost() -> None:
    layout = Layout(tp=2, dp=4, num_nodes=2)
    c = layout.coords(5)
    assert (c.node, c.local_rank, c.tp_rank, c.dp_rank, c.ep_rank, c.ep_group) == (1, 1, 1, 2, 5, 0)
    assert layout.node_ranks(1) == [4, 5, 6, 7]
    assert layout.rank_of(dp_rank=2, tp_rank=1) == 5
    assert not layout.tp_spans_nodes
    assert Layout(tp=4, dp=1, num_nodes=2).tp_spans_nodes


def test_slots_per_rank_and_owner() -> None:
    layout = Layout(dp=4)
    assert layout.num_local_slots(8) == 2
    assert list(layout.local_slots(3, 8)) == [6, 7]
    assert [layout.slot_owner(p, 8) for p in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    phy2log = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0], [7, 6, 5, 4, 3, 2, 1, 0]])
    local = layout.local_experts(phy2log, 3)
    assert local.shape == (2, 2)
    assert local.tolist() == [[6, 0], [1, 0]]


def test_smaller_ep_replicates_experts() -> None:
    layout = Layout(tp=1, dp=4, ep=2)
    assert layout.ep_groups() == [[0, 1], [2, 3]]
    assert list(layout.local_slots(2, 8)) == list(layout.local_slots(0, 8)) == [0, 1, 2, 3]
    assert layout.coords(3).ep_rank == 1 and layout.coords(3).ep_group == 1


def test_for_world() -> None:
    assert Layout.for_world(8, tp=2) == Layout(tp=2, dp=4)
    with pytest.raises(ValueError, match="tp=3 does not divide world_size=8"):
        Layout.for_world(8, tp=3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 0}, "Layout.tp must be a positive int, got 0"),
        ({"dp": 3, "num_nodes": 2}, "tp\\*dp = 1\\*3 = 3 is not divisible by num_nodes=2"),
        ({"dp": 4, "ep": 3}, "ep=3 does not divide the world size tp\\*dp = 4"),
        ({"ep": 0}, "Layout.ep must be a positive int or None"),
    ],
)
def test_invalid_layouts_name_the_numbers(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Layout(**kwargs)


def test_invalid_world_and_slots() -> None:
    layout = Layout(tp=2, dp=2)
    with pytest.raises(ValueError, match="tp=2 x dp=2 = 4 ranks does not match the world size 6"):
        layout.check_world_size(6)
    with pytest.raises(ValueError, match="num_slots=6 physical slots are not divisible by ep=4"):
        layout.num_local_slots(6)
    with pytest.raises(ValueError, match="rank 4 outside world of 4"):
        layout.coords(4)
    with pytest.raises(ValueError, match="slot 8 outside"):
        layout.slot_owner(8, 8)


@settings(max_examples=50, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), dp=st.integers(1, 6), nodes=st.sampled_from([1, 2]),
       ep_div=st.sampled_from([1, 2]))
def test_groups_partition_world(tp: int, dp: int, nodes: int, ep_div: int) -> None:
    world = tp * dp
    if world % nodes or world % ep_div:
        return
    layout = Layout(tp=tp, dp=dp, ep=world // ep_div, num_nodes=nodes)
    for groups in (layout.tp_groups(), layout.dp_groups(), layout.ep_groups()):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world))
    for rank in range(world):
        c = layout.coords(rank)
        assert rank in layout.tp_groups()[c.dp_rank] and rank in layout.dp_groups()[c.tp_rank]
        assert layout.ep_groups()[c.ep_group][c.ep_rank] == rank
        assert rank in layout.node_ranks(c.node)
    num_slots = layout.ep_size * 3
    hosted = sorted(p for r in layout.ep_groups()[0] for p in layout.local_slots(r, num_slots))
    assert hosted == list(range(num_slots))
