"""The EP MoE hop on 2 and 4 gloo ranks equals the single-process computation.

Each world size is spawned once per module; every scenario runs inside those ranks and
the assertions compare with ``scenarios.oracle`` here in the parent.
"""

from __future__ import annotations

import pytest
import torch

from moe.capacity import CapacityConfig
from parallel.dispatch import build_dispatcher
from parallel.groups import build_process_groups
from parallel.layout import Layout
from tests.dist.conftest import COLLECTIVE_TIMEOUT_S, run_ranks
from tests.dist.scenarios import Scenario, apply_local_capacity, build_experts, dp_inputs, oracle

P4 = (0, 1, 2, 3)
P8 = tuple(range(8))
REPLICATED = (0, 1, 2, 0, 3, 1, 2, 0)  # 4 logical experts on 8 slots

SCENARIOS_2 = [
    Scenario("a2a_dropless", 1, 2, "alltoall", (7, 3), P4),
    Scenario("ag_dropless", 1, 2, "allgather", (7, 3), P4),
    Scenario("a2a_rank_without_tokens", 1, 2, "alltoall", (6, 0), P4, seed=1),
    Scenario("ag_rank_without_tokens", 1, 2, "allgather", (0, 5), P4, seed=1),
    Scenario("a2a_no_tokens_anywhere", 1, 2, "alltoall", (0, 0), P4),
    Scenario("a2a_idle_experts_replicas", 1, 2, "alltoall", (9, 4), REPLICATED, top_k=3, unused_slots=(5, 6, 7)),
    Scenario("a2a_all_on_one_rank", 1, 2, "alltoall", (8, 8), P4, unused_slots=(2, 3), seed=2),
    Scenario("a2a_global_capacity", 1, 2, "alltoall", (12, 5), P4, capacity="global", capacity_factor=0.6,
             renormalize=True, drop_prob=0.0, seed=3),
    Scenario("ag_global_capacity", 1, 2, "allgather", (12, 5), P4, capacity="global", capacity_factor=0.6,
             drop_prob=0.0, seed=3),
    Scenario("a2a_global_capacity_no_tokens", 1, 2, "alltoall", (0, 0), P4, capacity="global", capacity_factor=0.6),
    Scenario("ag_global_capacity_no_tokens", 1, 2, "allgather", (0, 0), P4, capacity="global", capacity_factor=0.6),
    Scenario("a2a_local_capacity", 1, 2, "alltoall", (12, 5), P4, capacity="local", capacity_factor=0.5,
             renormalize=True, seed=4),
    Scenario("a2a_bf16", 1, 2, "alltoall", (7, 5), P8, top_k=3, hidden=6, dtype=torch.bfloat16, seed=5),
    Scenario("ag_bf16", 1, 2, "allgather", (7, 5), P8, top_k=3, hidden=6, dtype=torch.bfloat16, seed=5),
]

SCENARIOS_4 = [
    Scenario("ep4_a2a_uneven", 1, 4, "alltoall", (5, 0, 11, 2), P8, top_k=3),
    Scenario("ep4_ag_uneven", 1, 4, "allgather", (5, 0, 11, 2), P8, top_k=3),
    Scenario("ep4_a2a_replicas_idle", 1, 4, "alltoall", (6, 9, 1, 3), REPLICATED, top_k=3, unused_slots=(0, 1),
             seed=6),
    Scenario("ep4_a2a_global_capacity", 1, 4, "alltoall", (10, 3, 0, 8), P8, top_k=3, capacity="global",
             capacity_factor=0.7, renormalize=True, drop_prob=0.0, seed=7),
    Scenario("ep4_a2a_bf16", 1, 4, "alltoall", (9, 4, 7, 0), P8, top_k=4, hidden=6, dtype=torch.bfloat16),
    Scenario("tp2dp2_a2a", 2, 2, "alltoall", (9, 4), P8, top_k=3, seed=8),
    Scenario("tp2dp2_ag", 2, 2, "allgather", (9, 4), P8, top_k=3, seed=8),
    Scenario("tp2dp2_a2a_dp_rank_empty", 2, 2, "alltoall", (0, 5), P8, top_k=3, seed=9),
    Scenario("tp2dp2_a2a_single_token", 2, 2, "alltoall", (1, 3), P8, top_k=3, seed=10),
    Scenario("tp2dp2_a2a_global_capacity", 2, 2, "alltoall", (11, 6), P8, top_k=3, capacity="global",
             capacity_factor=0.5, drop_prob=0.0, seed=11),
    Scenario("tp2dp2_local_ep1", 2, 2, "local", (7, 2), P4, ep=1, seed=12),
]


def _run_scenarios(rank: int, world_size: int, scenarios: list[Scenario]) -> dict:
    groups_by_layout = {}
    results = {}
    for s in scenarios:
        layout = Layout(tp=s.tp, dp=s.dp, ep=s.ep)
        if layout not in groups_by_layout:  # same order on every rank: new_group is collective
            groups_by_layout[layout] = build_process_groups(layout, rank, timeout=COLLECTIVE_TIMEOUT_S)
        groups = groups_by_layout[layout]
        cap = CapacityConfig(s.capacity_factor, scope="global", renormalize=s.renormalize) if s.capacity == "global" else None
        dispatcher = build_dispatcher(s.backend, groups, layout, global_capacity=cap)
        experts = build_experts(s, layout.local_slots(rank, s.num_slots))
        x, ids, w = dp_inputs(s)[groups.coords.dp_rank]
        if s.capacity == "local":
            ids, w = apply_local_capacity(s, ids, w)
        out = dispatcher.dispatch_combine(x, ids, w, experts, layer_id=3)
        stats = getattr(dispatcher, "capacity_stats", {}).get(3)
        results[s.name] = {"out": out, "dp_rank": groups.coords.dp_rank, "stats": stats,
                           "ep_rank": dispatcher.rank, "num_ranks": dispatcher.num_ranks}
    return results


@pytest.fixture(scope="module")
def results_2() -> list[dict]:
    return run_ranks(_run_scenarios, 2, SCENARIOS_2)


@pytest.fixture(scope="module")
def results_4() -> list[dict]:
    return run_ranks(_run_scenarios, 4, SCENARIOS_4)


def _check(s: Scenario, per_rank: list[dict]) -> None:
    expected, stats = oracle(s)
    tol = {"atol": 1e-5, "rtol": 1e-5} if s.dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    for rank, res in enumerate(per_rank):
        got = res[s.name]
        want = expected[got["dp_rank"]]
        assert got["out"].dtype == torch.float32
        assert got["out"].shape == (s.tokens[got["dp_rank"]], s.hidden), f"rank {rank}"
        torch.testing.assert_close(got["out"], want, **tol, msg=lambda m, r=rank: f"rank {r}: {m}")
        if s.capacity == "global":  # per-rank counts, group-wide fullest slot and C
            assert (got["stats"].max_slot_load, got["stats"].capacity) == (stats.max_slot_load, stats.capacity)
    if s.capacity == "global":
        mine = [r[s.name]["stats"] for r in per_rank]
        assert sum(m.assignments for m in mine) == stats.assignments
        assert sum(m.dropped for m in mine) == stats.dropped
        assert stats.dropped > 0 or sum(s.tokens) == 0  # the scenario really exercises the cap
    if s.capacity == "none" and any(n for n in s.tokens):
        assert any(float(r[s.name]["out"].abs().max()) > 0 for r in per_rank if r[s.name]["out"].numel())


@pytest.mark.parametrize("scenario", SCENARIOS_2, ids=lambda s: s.name)
def test_two_ranks(scenario: Scenario, results_2: list[dict]) -> None:
    _check(scenario, results_2)
    assert [r[scenario.name]["ep_rank"] for r in results_2] == [0, 1]


@pytest.mark.parametrize("scenario", SCENARIOS_4, ids=lambda s: s.name)
def test_four_ranks(scenario: Scenario, results_4: list[dict]) -> None:
    _check(scenario, results_4)
    expected_ep = [0, 0, 0, 0] if scenario.ep == 1 else [0, 1, 2, 3]
    assert [r[scenario.name]["ep_rank"] for r in results_4] == expected_ep
