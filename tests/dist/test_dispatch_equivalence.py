"""The EP MoE hop on 2 and 4 gloo ranks equals the single-process computation.

Each world size is spawned once per module; every scenario runs inside those ranks and
the assertions compare with ``scenarios.oracle`` here in the parent. Each scenario runs four
ways: with the groups' shared memory (``parallel.shm_allreduce``: every exchange fits), without
it (gloo alone), with a segment just large enough for the largest rank's packed rows (some
exchanges fit, the rest fall back to gloo mid-step) and with one a byte short of that.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe.capacity import CapacityConfig
from parallel.dispatch import build_dispatcher
from parallel.dispatch.plan import row_layout
from parallel.groups import ProcessGroups, build_process_groups
from parallel.layout import Layout
from parallel.shm_allreduce import ShmAllReduce
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


TRANSPORTS = ("shm", "gloo", "tight", "short")


def _transports(s: Scenario, groups: ProcessGroups, layout: Layout) -> dict[str, ProcessGroups]:
    """The scenario's groups four ways (``TRANSPORTS``). Collective: every rank, same order."""
    tight = max(1, max(s.tokens)) * row_layout(s.hidden, s.top_k, s.dtype)[1]

    def segments(capacity: int) -> ProcessGroups:
        tp = ShmAllReduce.for_group(groups.tp, capacity_bytes=capacity) if layout.tp > 1 else None
        ep = ShmAllReduce.for_group(groups.ep, capacity_bytes=capacity) if layout.ep_size > 1 else None
        return dataclasses.replace(groups, tp_shm=tp, ep_shm=ep)

    return {"shm": groups, "gloo": dataclasses.replace(groups, tp_shm=None, ep_shm=None),
            "tight": segments(tight), "short": segments(tight - 1)}


def _run_scenarios(rank: int, world_size: int, scenarios: list[Scenario]) -> dict:
    groups_by_layout = {}
    results = {}
    for s in scenarios:
        layout = Layout(tp=s.tp, dp=s.dp, ep=s.ep)
        if layout not in groups_by_layout:  # same order on every rank: new_group is collective
            groups_by_layout[layout] = build_process_groups(layout, rank, timeout=COLLECTIVE_TIMEOUT_S)
        cap = CapacityConfig(s.capacity_factor, scope="global", renormalize=s.renormalize) if s.capacity == "global" else None
        results[s.name] = {}
        for transport, groups in _transports(s, groups_by_layout[layout], layout).items():
            dispatcher = build_dispatcher(s.backend, groups, layout, global_capacity=cap)
            experts = build_experts(s, layout.local_slots(rank, s.num_slots))
            x, ids, w = dp_inputs(s)[groups.coords.dp_rank]
            if s.capacity == "local":
                ids, w = apply_local_capacity(s, ids, w)
            out = dispatcher.dispatch_combine(x, ids, w, experts, layer_id=3)
            stats = getattr(dispatcher, "capacity_stats", {}).get(3)
            results[s.name][transport] = {"out": out, "dp_rank": groups.coords.dp_rank, "stats": stats,
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
    for transport in TRANSPORTS:
        for rank, res in enumerate(per_rank):
            got = res[s.name][transport]
            want = expected[got["dp_rank"]]
            assert got["out"].dtype == torch.float32
            assert got["out"].shape == (s.tokens[got["dp_rank"]], s.hidden), f"rank {rank}, {transport}"
            torch.testing.assert_close(got["out"], want, **tol, msg=lambda m, r=rank, t=transport: f"rank {r}, {t}: {m}")
            if s.capacity == "global":  # per-rank counts, group-wide fullest slot and C
                assert (got["stats"].max_slot_load, got["stats"].capacity) == (stats.max_slot_load, stats.capacity)
        if s.capacity == "global":
            mine = [r[s.name][transport]["stats"] for r in per_rank]
            assert sum(m.assignments for m in mine) == stats.assignments
            assert sum(m.dropped for m in mine) == stats.dropped
            assert stats.dropped > 0 or sum(s.tokens) == 0  # the scenario really exercises the cap
        if s.capacity == "none" and any(n for n in s.tokens):
            assert any(float(r[s.name][transport]["out"].abs().max()) > 0 for r in per_rank
                       if r[s.name][transport]["out"].numel())


@pytest.mark.parametrize("scenario", SCENARIOS_2, ids=lambda s: s.name)
def test_two_ranks(scenario: Scenario, results_2: list[dict]) -> None:
    _check(scenario, results_2)
    assert [r[scenario.name]["shm"]["ep_rank"] for r in results_2] == [0, 1]


@pytest.mark.parametrize("scenario", SCENARIOS_4, ids=lambda s: s.name)
def test_four_ranks(scenario: Scenario, results_4: list[dict]) -> None:
    _check(scenario, results_4)
    expected_ep = [0, 0, 0, 0] if scenario.ep == 1 else [0, 1, 2, 3]
    assert [r[scenario.name]["shm"]["ep_rank"] for r in results_4] == expected_ep
