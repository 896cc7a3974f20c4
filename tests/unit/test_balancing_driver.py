"""launch/balancing.py EplbDriver on its own (no Ray): the forecast trigger keeps a
per-step logical window across rebalances, checks every check_interval steps, and stays
or moves as rebalance_from_history decides; the interval trigger keeps vLLM's schedule."""

from __future__ import annotations

import numpy as np
import torch

from balancer import BalancerConfig, HistoryOptions, Placement, plan_from_history
from launch.balancing import EplbDriver
from launch.expert_location import read_expert_distribution_dump


def _driver(**config):
    cfg = BalancerConfig(enable_eplb=True, num_redundant_experts=4, window_size=256, **config)
    placement = Placement.identity(2, 8, 4, 4)  # L=2, E=8, P=12, 4 GPUs
    return EplbDriver(cfg, placement, num_groups=1, num_nodes=1, expert_bytes=1 << 20)


def _slot_load(driver, logical):
    """logical [L, E] -> [L, P] slot load, split evenly over the replicas in force."""
    p = driver.placement
    counts = p.logcnt.to(torch.float64)
    share = torch.from_numpy(np.asarray(logical, dtype=np.float64)) / counts
    return torch.gather(share, 1, p.phy2log).round().to(torch.int64)


def test_forecast_trigger_checks_at_its_interval_and_moves_for_a_hot_expert():
    driver = _driver(check_interval=32)
    rng = np.random.default_rng(0)
    hot = np.full((2, 8), 40.0)
    hot[:, 5] = 600.0  # expert 5 (one copy in the identity placement) is hot
    for step in range(1, 65):
        driver.record(_slot_load(driver, rng.poisson(hot)))
        assert driver.due() == (step % 32 == 0)
    assert driver.history().shape == (64, 2, 8)
    new, plan, prediction = driver.plan_rebalance()
    assert (new.logcnt[:, 5] >= 2).all() and plan.num_copies_moved > 0
    assert "move" in driver.last_reason
    driver.commit(new, plan, 0.0)
    assert driver.history().shape == (64, 2, 8)  # logical history survives the move
    # the same load again: nothing left to gain
    for _ in range(64):
        driver.record(_slot_load(driver, rng.poisson(hot)))
    again, plan, _ = driver.plan_rebalance()
    assert torch.equal(again.phy2log, new.phy2log) and plan.num_copies_moved == 0
    assert "stay" in driver.last_reason


def test_history_is_a_ring_oldest_first():
    driver = _driver()
    for step in range(300):
        driver.record(_slot_load(driver, np.full((2, 8), 2 * (step % 7 + 1))))
    hist = driver.history()
    assert hist.shape == (256, 2, 8)
    assert hist[-1, 0].sum() == (299 % 7 + 1) * 16 and hist[0, 0].sum() == (44 % 7 + 1) * 16


def test_interval_trigger_keeps_vllms_schedule():
    driver = _driver(step_interval=10, min_balancedness_to_skip=1.0)  # vLLM's names: interval trigger
    assert driver.config.resolved_trigger == "interval"
    skew = np.full((2, 8), 10.0)
    skew[:, 0] = 200.0
    due = []
    for _ in range(20):
        driver.record(_slot_load(driver, skew))
        due.append(driver.due())
    assert [i + 1 for i, d in enumerate(due) if d] == [10, 20]


def test_statistics_decision_plan_and_dump_round_trip(tmp_path):
    """record -> due -> plan_rebalance -> commit -> dump written and read back: the dump holds
    exactly the recorded per-step loads and the placement now in force, and loading it as an
    initial placement gives that placement back."""
    from launch.expert_location import placement_from_dump, read_expert_distribution_dump

    driver = _driver(check_interval=16)
    driver.start_record()
    rng = np.random.default_rng(1)
    load = np.full((2, 8), 30.0)
    load[0, 2] = load[1, 6] = 500.0  # a hot expert per layer
    recorded = []
    for _ in range(16):
        logical = rng.poisson(load)
        slot = _slot_load(driver, logical)
        recorded.append(torch.zeros(2, 8, dtype=torch.int64).scatter_add_(1, driver.placement.phy2log, slot))
        driver.record(slot)
    assert driver.due()
    new, plan, predicted = driver.plan_rebalance()
    assert new.logcnt[0, 2] >= 2 and new.logcnt[1, 6] >= 2  # each hot expert gains a replica
    assert plan.num_copies_moved > 0 and plan.total_bytes == plan.num_copies_moved * (1 << 20)
    assert predicted.overall > driver.balancedness()[1] and predicted.rank_load.shape == (2, 4)
    driver.commit(new, plan, 0.25)
    assert driver.counters.num_rebalances == 1 and driver.counters.expert_copies_moved == plan.num_copies_moved
    path = driver.dump_record(tmp_path)
    dump = read_expert_distribution_dump(path)
    assert dump["logical_count"].shape == (16, 2, 8)
    assert torch.equal(dump["logical_count"], torch.stack(recorded))
    assert dump["physical_count"].shape == (16, 2, 12)
    assert torch.equal(dump["phy2log"], new.phy2log)
    assert torch.equal(dump["logcnt"], new.logcnt)
    back = placement_from_dump(path, num_layers=2, num_experts=8, num_physical_experts=12, num_gpus=4)
    assert torch.equal(back.phy2log, new.phy2log)


def test_cheap_checks_between_full_evaluations_and_a_burst_is_answered_at_the_next_check():
    """check_interval 16, full_check_interval 64: the first check is a full evaluation;
    the checks in between stay cheaply (no forecast) while the load is as before; a full
    evaluation runs again 64 steps later; a burst is answered at the next 16-step check."""
    driver = _driver(check_interval=16, full_check_interval=64)
    rng = np.random.default_rng(2)
    load = np.full((2, 8), 40.0)
    load[:, 5] = 600.0
    reasons = {}

    def run(steps, rates):
        for _ in range(steps):
            driver.record(_slot_load(driver, rng.poisson(rates)))
            if driver.due():
                new, plan, _ = driver.plan_rebalance()
                reasons[driver.step] = driver.last_reason
                if plan.num_copies_moved:
                    driver.commit(new, plan, 0.0)

    run(80, load)
    assert sorted(reasons) == [16, 32, 48, 64, 80]
    assert "move" in reasons[16] and (driver.placement.logcnt[:, 5] >= 2).all()
    assert all("as well as" in reasons[s] for s in (32, 48, 64))  # cheap stays
    assert "as well as" not in reasons[80]  # 64 steps after the last full one: full again
    burst = load.copy()
    burst[:, 2] = 900.0  # a cold expert flares up after step 84
    run(4, load)
    for _ in range(12):
        driver.record(_slot_load(driver, rng.poisson(burst)))
    assert driver.step == 96 and driver.due()
    full = plan_from_history(driver.history(), 12, 1, 1, 4, old_phy2log=driver.placement.phy2log,
                             options=HistoryOptions(interval=16, step_cost=driver.config.step_seconds,
                                                    slot_cost=(1 << 20) / driver.config.transfer_bytes_per_s))
    new, plan, _ = driver.plan_rebalance()  # 16 steps after a full one, but the burst escalates it
    assert "as well as" not in driver.last_reason and driver.last_reason == full.reason
    assert np.array_equal(new.phy2log.numpy(), full.phy2log)


def test_every_check_is_full_when_the_next_would_come_too_late():
    """check_interval 40 > full_check_interval / 2: no early stays (as before the early check)."""
    driver = _driver(check_interval=40, full_check_interval=64)
    rng = np.random.default_rng(5)
    load = np.full((2, 8), 40.0)
    load[:, 3] = 500.0
    for _ in range(160):
        driver.record(_slot_load(driver, rng.poisson(load)))
        if driver.due():
            new, plan, _ = driver.plan_rebalance()
            assert "as well as" not in driver.last_reason
            if plan.num_copies_moved:
                driver.commit(new, plan, 0.0)


def test_logical_history_is_the_slot_load_summed_per_expert_with_or_without_replicas():
    cfg = BalancerConfig(enable_eplb=True, num_redundant_experts=0, window_size=8)
    driver = EplbDriver(cfg, Placement.identity(2, 8, 0, 4), num_groups=1, num_nodes=1, expert_bytes=1)
    assert driver._slots_are_experts()  # P = E, slot i holds expert i: the counts are taken as they are
    slot = torch.arange(16, dtype=torch.int64).reshape(2, 8)
    driver.record(slot)
    assert torch.equal(driver.history()[-1], slot.to(torch.int32))
    swapped = Placement.from_phy2log(torch.tensor([[1, 0, 2, 3, 4, 5, 6, 7]] * 2), 8, 4)
    driver.placement = swapped  # same shape, another order: slot 0 now holds expert 1
    assert not driver._slots_are_experts()
    driver.record(slot)
    assert driver.history()[-1].tolist() == [[1, 0, 2, 3, 4, 5, 6, 7], [9, 8, 10, 11, 12, 13, 14, 15]]
    replicated = _driver()  # P = 12 > E = 8: replicas' loads add up per expert
    assert not replicated._slots_are_experts()
    load = torch.ones(2, 12, dtype=torch.int64)
    replicated.record(load)
    want = torch.zeros(2, 8, dtype=torch.int64).scatter_add_(1, replicated.placement.phy2log, load)
    assert torch.equal(replicated.history()[-1], want.to(torch.int32))


def test_owned_steps_applied_in_batches_equal_steps_applied_at_once(tmp_path):
    """The engine hands its per-step loads over (owned=True): the driver applies them in batches,
    before anything reads the window or the history, under the placement each step ran with, and
    a distribution record started mid-way holds exactly the steps recorded while it ran."""
    rng = np.random.default_rng(3)
    cfg = BalancerConfig(enable_eplb=True, num_redundant_experts=4, window_size=16)
    eager, lazy = (EplbDriver(cfg, Placement.identity(2, 8, 4, 4), num_groups=1, num_nodes=1, expert_bytes=1)
                   for _ in range(2))
    swapped = Placement.from_phy2log(eager.placement.phy2log.flip(1), 8, 4)

    def both(step: int) -> None:
        load = _slot_load(eager, rng.poisson(np.linspace(1, 9, 8), (2, 8)))
        eager.record(load.clone())
        lazy.record(load, owned=True)
        assert lazy.step == eager.step == step

    step = 0
    for _ in range(5):
        both(step := step + 1)
    assert len(lazy._pending) == 5  # not applied yet
    assert lazy.balancedness(applied=True) == ([1.0, 1.0], 1.0)  # what a per-step snapshot sees: no steps yet
    assert torch.equal(lazy.stats.local_window(), eager.stats.local_window()) and not lazy._pending
    assert lazy.balancedness() == eager.balancedness() != ([1.0, 1.0], 1.0)
    for _ in range(30):  # past the window; and a placement change with steps pending
        both(step := step + 1)
    for driver in (eager, lazy):
        driver.placement = swapped
    for _ in range(5):
        both(step := step + 1)
    assert torch.equal(lazy.history(), eager.history())  # 11 steps before the swap, 5 after
    for _ in range(70):  # past MAX_PENDING_STEPS
        both(step := step + 1)
    assert torch.equal(lazy.history(), eager.history()) and lazy.history().shape == (16, 2, 8)
    assert torch.equal(lazy.stats.local_window(), eager.stats.local_window())
    assert lazy.balancedness(applied=True) == lazy.balancedness() == eager.balancedness()
    lazy.stats.reset()  # from outside (a sweep does): the next balancedness is of the empty window
    assert lazy.balancedness() == ([1.0, 1.0], 1.0)
    eager.stats.reset()
    for driver in (eager, lazy):
        driver.start_record()
    for _ in range(3):
        both(step := step + 1)
    for driver in (eager, lazy):
        driver.stop_record()
    both(step := step + 1)
    a = read_expert_distribution_dump(eager.dump_record(tmp_path / "eager"))
    b = read_expert_distribution_dump(lazy.dump_record(tmp_path / "lazy"))
    assert a.keys() == b.keys() and a["logical_count"].shape[0] == 3
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(lazy.history(), eager.history())
