"""The balancing side of the driver: statistics window, trigger, rebalance, distribution record.

Decide once here, broadcast the same move plan to every worker, switch together.
Two triggers (``BalancerConfig.resolved_trigger``): "forecast" (default) keeps the last
``window_size`` steps of per-expert loads and every ``check_interval`` steps asks
``rebalance_from_history``, which moves only when the modeled gain pays for the moved
slots; "interval" is vLLM's schedule (every ``step_interval`` steps, the window's sum),
chosen by ``trigger`` or by giving ``step_interval`` (vLLM's names, vLLM's behaviour).
Between full evaluations (every ``full_check_interval`` steps) a check first tests whether
the last steps are balanced as well as before and stays cheaply if so.
Shape legend: L MoE layers, E logical experts, P physical slots, R EP ranks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from balancer import (
    BalancerConfig,
    HistoryOptions,
    Placement,
    RoutingStats,
    compute_move_plan,
    full_horizon,
    plan_from_history,
    predict,
    rebalance_experts,
    should_rebalance,
)
from balancer.balancedness import rank_load_of_slots
from launch.expert_location import DEFAULT_RECORDER_BUFFER_SIZE, ExpertDistributionRecorder

log = logging.getLogger(__name__)

# Steps recorded with owned=True are applied at the latest after this many (and before any read).
MAX_PENDING_STEPS = 64


@dataclass
class BalancerCounters:
    num_rebalances: int = 0
    rebalance_seconds_total: float = 0.0
    expert_copies_moved: int = 0
    bytes_moved: int = 0
    num_stays: int = 0  # checks that planned and kept the placement (the forecast said a move would not pay)
    stay_seconds_total: float = 0.0  # their planning time, spent in the engine's step as a move's is


class EplbDriver:
    """Owns the placement in force and the routing-statistics window (driver side)."""

    def __init__(self, config: BalancerConfig, placement: Placement, *, num_groups: int, num_nodes: int,
                 expert_bytes: int, record_buffer_size: int = DEFAULT_RECORDER_BUFFER_SIZE) -> None:
        self.config = config
        self.placement = placement
        self._identity_of: tuple[torch.Tensor, int] | None = None  # (phy2log, its version) _identity was taken on
        self._identity = False
        self.num_groups = num_groups
        self.num_nodes = num_nodes
        self.expert_bytes = expert_bytes
        self._stats = RoutingStats(placement.num_layers, placement.num_physical, placement.num_gpus,
                                   config.window_size)
        # steps recorded with owned=True and not applied yet: (slot_load [L, P], phy2log in force)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._balancedness: tuple[int, tuple[list[float], float]] | None = None  # (stats.version, value)
        self.counters = BalancerCounters()
        self.step = 0
        self.last_balancedness: list[float] = [1.0] * placement.num_layers
        self.recorder = ExpertDistributionRecorder(record_buffer_size)
        # [window, L, E] per-step logical loads, a ring (kept across rebalances: logical ids do not move)
        self._history = torch.zeros(config.window_size, placement.num_layers, placement.num_logical,
                                    dtype=torch.int32)
        self._num_history = 0
        self._last_full_step: int | None = None  # step of the last full (not early-stay) evaluation
        self.last_reason = ""
        # every step since the start, under the placement in force at each (never reset by a rebalance,
        # unlike the window): tokens per EP rank [L, R] and per logical expert [L, E] (``run_totals``)
        self._run_rank_load = torch.zeros(placement.num_layers, placement.num_gpus, dtype=torch.float64)
        self._run_logical = torch.zeros(placement.num_layers, placement.num_logical, dtype=torch.int64)

    # ---- statistics ------------------------------------------------------------------

    @property
    def stats(self) -> RoutingStats:
        """The routing-statistics window, every recorded step applied."""
        self._apply_pending()
        return self._stats

    def record(self, slot_load: torch.Tensor, dropped: torch.Tensor | None = None, *, owned: bool = False) -> None:
        """slot_load: [L, P] int64 assignments per slot this step, summed over DP ranks;
        dropped: [L] int64 assignments dropped by expert capacity this step (None: dropless).
        owned: the caller hands slot_load over (never writes it again), so the step may be applied
        later, with others in one batch (before anything reads the window or the history): the
        engine records every step, ~0.1 ms of a ~6 ms batch-1 step when applied one by one."""
        self.step += 1
        if (owned and dropped is None and not self.recorder.is_recording and not self.config.log_balancedness
                and self.config.resolved_trigger == "forecast"):  # "interval" reads the window every step
            self._pending.append((slot_load, self.placement.phy2log))
            if len(self._pending) >= MAX_PENDING_STEPS:
                self._apply_pending()
            return
        self._apply_pending()
        self._stats.record(slot_load)
        physical = slot_load.to(torch.int64).cpu()
        logical = self._logical(physical[None], self.placement.phy2log)[0]
        self._history[self._num_history % self.config.window_size] = logical
        self._num_history += 1
        self._add_to_run(physical[None], logical[None])
        self.recorder.record(logical, physical, dropped)  # a no-op unless recording
        if self.config.log_balancedness and self.step % 10 == 0:
            per_layer, overall = self._stats.balancedness()
            log.info("eplb step %d: balancedness %.4f (worst layer %.4f)", self.step, overall, float(per_layer.min()))

    def _apply_pending(self) -> None:
        """Apply the steps recorded with owned=True, in order, each run of one placement in one batch."""
        pending, self._pending = self._pending, []
        start = 0
        while start < len(pending):
            phy2log = pending[start][1]
            end = start + 1
            while end < len(pending) and pending[end][1] is phy2log:
                end += 1
            physical = torch.stack([load for load, _ in pending[start:end]]).to(torch.int64).cpu()  # [K, L, P]
            self._stats.record_many(physical)
            logical = self._logical(physical, phy2log)
            self._record_history(logical)
            self._add_to_run(physical, logical)
            start = end

    def _add_to_run(self, physical: torch.Tensor, logical: torch.Tensor) -> None:
        """Add K steps' slot loads physical [K, L, P] and logical loads [K, L, E] to the run's totals."""
        self._run_rank_load += torch.from_numpy(rank_load_of_slots(physical.sum(0), self.placement.num_gpus))
        self._run_logical += logical.sum(0).to(torch.int64)

    def run_totals(self, *, applied: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens per EP rank [L, R] float64, tokens per logical expert [L, E] int64) over every step
        recorded since the start, each under the placement in force at its step (copies). Two snapshots'
        difference covers the steps between them whatever rebalanced in between; the window
        (``stats``) starts over at each rebalance. applied: the steps applied so far (up to
        MAX_PENDING_STEPS behind; what a stats snapshot taken every step reads)."""
        if not applied:
            self._apply_pending()
        return self._run_rank_load.clone(), self._run_logical.clone()

    def _logical(self, physical: torch.Tensor, phy2log: torch.Tensor) -> torch.Tensor:
        """[K, L, E] int64 per-expert loads of K steps' slot loads physical [K, L, P] under phy2log [L, P]."""
        if self._slots_are_experts(phy2log):  # slot i hosts expert i, once: the loads are the same counts
            return physical
        steps, layers, slots = physical.shape
        logical = torch.zeros(steps, layers, self.placement.num_logical, dtype=torch.int64)
        return logical.scatter_add_(2, phy2log.to(torch.int64).expand(steps, layers, slots), physical)

    def _record_history(self, logical: torch.Tensor) -> None:
        """Append K steps' logical loads [K, L, E] to the history ring."""
        w = self.config.window_size
        kept = logical[-w:]
        first = self._num_history + logical.shape[0] - kept.shape[0]
        self._history[(first + torch.arange(kept.shape[0])) % w] = kept.to(self._history.dtype)
        self._num_history += logical.shape[0]

    def _slots_are_experts(self, phy2log: torch.Tensor | None = None) -> bool:
        """Whether phy2log [L, P] (default: the placement in force) is the identity (arange(E) in
        every layer), remembered per phy2log tensor and version (a batch-1 step records every step).
        The tensor itself is held, not its id: a freed placement's id can come back for another one."""
        if phy2log is None:
            phy2log = self.placement.phy2log
        seen = self._identity_of
        if seen is None or seen[0] is not phy2log or seen[1] != phy2log._version:
            E = self.placement.num_logical
            self._identity = phy2log.shape[1] == E and bool((phy2log == torch.arange(E)).all())
            self._identity_of = (phy2log, phy2log._version)
        return self._identity

    def balancedness(self, *, applied: bool = False) -> tuple[list[float], float]:
        """(per layer [L], overall) over the window; 1.0 with no data. applied: over the steps
        applied so far (those recorded with owned=True may be up to MAX_PENDING_STEPS behind),
        computed once per change of that window: what a stats snapshot taken every step reads."""
        stats = self._stats if applied else self.stats
        key = stats.version
        if self._balancedness is None or self._balancedness[0] != key:
            if stats.num_steps == 0:
                value = [1.0] * self.placement.num_layers, 1.0
            else:
                per_layer, overall = stats.balancedness()
                value = [float(x) for x in per_layer], float(overall)
            self._balancedness = (key, value)
        per_layer, overall = self._balancedness[1]
        return list(per_layer), overall

    # ---- rebalancing -----------------------------------------------------------------

    def history(self) -> torch.Tensor:
        """[W, L, E] int32 per-step logical loads, oldest first (W <= window_size)."""
        self._apply_pending()
        w = self.config.window_size
        if self._num_history <= w:
            return self._history[:self._num_history]
        pos = self._num_history % w
        return torch.cat([self._history[pos:], self._history[:pos]])

    def due(self) -> bool:
        if self.config.resolved_trigger == "forecast":
            return self.config.enable_eplb and self.step > 0 and self.step % self.config.check_interval == 0
        return bool(should_rebalance(self.step, self.stats, self.config))

    def plan_rebalance(self):
        """Compute (new Placement, MovePlan, predicted balancedness) from the window; with the
        forecast trigger the new placement may be the old one (then the plan moves nothing)."""
        load = self.stats.logical_load(self.placement.phy2log)  # [L, E]
        args = (self.placement.num_physical, self.num_groups, self.num_nodes, self.placement.num_gpus)
        if self.config.resolved_trigger == "forecast" and self._num_history > 0:
            c = self.config
            # Between full evaluations the cheap check comes first (it stays unless the last
            # steps got worse); a check is full when the next one would come later than
            # full_check_interval steps after the last full one.
            early = (self._last_full_step is not None
                     and self.step - self._last_full_step + c.check_interval <= c.full_check_interval)
            if not early:
                self._last_full_step = self.step
            # horizon: the next check (an early one that escalates) or the next full evaluation
            interval = c.check_interval if early else full_horizon(c.check_interval, c.full_check_interval)
            options = HistoryOptions(interval=interval, step_cost=c.step_seconds, margin=c.move_margin,
                                     slot_cost=self.expert_bytes / c.transfer_bytes_per_s, policy=c.resolved_policy,
                                     early_stay=early)
            decision = plan_from_history(self.history(), *args, old_phy2log=self.placement.phy2log, options=options)
            phy2log = torch.from_numpy(decision.phy2log)
            self.last_reason = decision.reason
        else:
            phy2log, _, _ = rebalance_experts(load, *args, old_phy2log=self.placement.phy2log,
                                              policy=self.config.resolved_policy)
            self.last_reason = "rebalance on the window's sum"
        new = Placement.from_phy2log(phy2log, self.placement.num_logical, self.placement.num_gpus)
        plan = compute_move_plan(self.placement.phy2log, new.phy2log, new.num_gpus,
                                 new.num_gpus // self.num_nodes, self.expert_bytes)
        return new, plan, predict(load, new.phy2log, new.num_gpus)

    def stay(self, seconds: float) -> None:
        """Count a check that planned and kept the placement in force (``seconds``: its planning)."""
        self.counters.num_stays += 1
        self.counters.stay_seconds_total += seconds

    def commit(self, new: Placement, plan, seconds: float) -> None:
        self.placement = new
        self.stats.reset()
        self.counters.num_rebalances += 1
        self.counters.rebalance_seconds_total += seconds
        self.counters.expert_copies_moved += plan.num_copies_moved
        self.counters.bytes_moved += plan.total_bytes

    # ---- SGLang-style expert distribution record --------------------------------------

    def start_record(self) -> None:
        self._apply_pending()
        self.recorder.start()

    def stop_record(self) -> None:
        self.recorder.stop()

    def dump_record(self, directory: str | Path, metadata: dict[str, str] | None = None) -> Path:
        """Write the record (``launch.expert_location`` format: logical_count [steps, L, E],
        physical_count [steps, L, P], dropped_count [steps, L] when capacity dropped, the
        placement in force now) and empty it. ``metadata``: extra string entries."""
        return self.recorder.dump(directory, self.placement, metadata)
