"""Worker faults: what they are called, and the supervisor that decides what happens next.

A worker rank can die (its process exits), fail (a collective broke under it, e.g. a peer
vanished or stalled past ``parallel.collective_timeout_s``) or stop answering the driver
(``recovery.step_timeout_s``). Each surfaces on the driver as one ``WorkerFault``
naming the rank; Ray's own text (actor ids, namespaces, OOM advice) goes to the log
once, never to a client.

The engine then, in order (``launch.engine.LLMEngine``):

1. fails or requeues its requests: one that has produced no token yet (so nothing was
   streamed) and has been retried fewer than ``recovery.max_request_retries`` times goes
   back to the waiting queue from scratch; every other one ends with
   ``finish_reason="error"``, which ``AsyncLLM`` turns into ``EngineRecoveringError``
   (HTTP 503 with the reason, or an SSE error event then ``[DONE]``). Every KV block is
   forgotten (the new workers have empty caches), the prefix cache included.
2. rebuilds the worker group (``RayExecutor.restart``): new actors in the placement
   group, a fresh rendezvous, shards reloaded from the checkpoint with the placement in
   force. While it does, ``state == "recovering"``: ``/health`` and new requests get 503.
3. serves again, or, when ``max_restarts`` faults fall within ``restart_window_s`` (a
   worker that keeps dying) or no rebuild succeeds, stops for good with
   ``EngineDeadError`` (``state == "dead"``: ``/health`` 503 permanently).

Restarts wait ``backoff_s`` doubling per consecutive fault, capped at ``max_backoff_s``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

SERVING, RECOVERING, DEAD = "serving", "recovering", "dead"
ENGINE_STATES = (SERVING, RECOVERING, DEAD)


# ---- errors ------------------------------------------------------------------------------


class WorkerFault(RuntimeError):
    """A rank the driver needs is gone or broken. ``rank``: the rank that reported (or
    -1 when several ranks stopped answering); ``summary``: one line a client may read;
    ``detail``: everything else, for the log."""

    def __init__(self, summary: str, rank: int = -1, detail: str = "") -> None:
        super().__init__(summary)
        self.summary, self.rank, self.detail = summary, rank, detail

    def __reduce__(self):  # picklable with all three fields (crosses Ray and process pools)
        return type(self), (self.summary, self.rank, self.detail)


class WorkerDiedError(WorkerFault):
    """A worker's process exited (killed, crashed, its node lost)."""


class WorkerCallError(WorkerFault):
    """A worker raised while executing a method (a broken or timed-out collective, or a bug).
    ``cause``: the worker's exception where the driver could rebuild it (None after pickling)."""

    cause: BaseException | None = None


class WorkerTimeoutError(WorkerFault, TimeoutError):
    """Ranks did not answer the driver within the call's timeout (a hang outside collectives)."""


class CollectiveError(RuntimeError):
    """Raised inside a worker: a collective did not complete; names the rank and the collective."""


class PeerGoneError(CollectiveError):
    """A collective broke because a peer rank's connection closed: the fault is most likely
    that peer's, not the raising rank's (the driver asks Ray which rank died)."""


class EngineRecoveringError(RuntimeError):
    """The engine lost a worker and is rebuilding; the request may be sent again shortly (503)."""


class EngineDeadError(RuntimeError):
    """The engine stopped for good (a worker that keeps dying, or an internal error) (503)."""


# ---- policy ------------------------------------------------------------------------------


@dataclass
class RecoveryCounters:
    num_worker_faults: int = 0
    num_recoveries: int = 0
    recovery_seconds_total: float = 0.0
    num_requests_retried: int = 0
    num_requests_failed: int = 0
    last_fault_time: float = 0.0  # clock time the latest fault reached the driver
    last_detect_seconds: float = 0.0  # fault raised -> requests failed or requeued
    last_recovery_seconds: float = 0.0  # fault raised -> serving again


@dataclass
class Supervisor:
    """Engine state and the fault policy (``launch.config.RecoveryConfig``); no processes.

    ``on_fault`` records a fault (state "recovering", or "dead" with recovery off); ``may_retry``
    is the per-request policy; ``next_attempt`` hands out the
    backoff before each rebuild (raising ``EngineDeadError`` when none is left);
    ``on_recovered`` closes the episode. ``clock``/``sleep`` are injectable for tests.
    """

    config: object
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    state: str = SERVING
    reason: str = ""
    last_fault: str = ""  # summary of the latest worker fault
    counters: RecoveryCounters = field(default_factory=RecoveryCounters)
    _faults: deque = field(default_factory=deque)  # clock times of recent faults
    _fault_started: float | None = None
    _attempts: int = 0
    _request_retries: dict[str, int] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(getattr(self.config, "enable_recovery", True))

    @property
    def needs_recovery(self) -> bool:
        return self.state == RECOVERING

    def on_fault(self, exc: WorkerFault) -> None:
        """Record ``exc``: the engine is recovering from now on (or dead, if recovery is off)."""
        now = self.clock()
        self.counters.num_worker_faults += 1
        self._faults.append(now)
        window = float(self.config.restart_window_s)
        while self._faults and now - self._faults[0] > window:
            self._faults.popleft()
        if self._fault_started is None:
            self._fault_started = now
        self.last_fault = exc.summary
        self.counters.last_fault_time = now
        log.warning("%s%s", exc.summary, f" ({exc.detail})" if exc.detail else "")
        if not self.enabled:
            self.stop(f"{exc.summary}; recovery is off (recovery.enable_recovery=false)")
            return
        self.state, self.reason = RECOVERING, f"{exc.summary}; engine recovering"

    def may_retry(self, request_id: str, num_output_tokens: int) -> bool:
        """The retry policy: nothing generated (hence nothing streamed), retries left."""
        if num_output_tokens > 0:
            return False
        return self._request_retries.get(request_id, 0) < int(self.config.max_request_retries)

    def on_requests_reset(self, retried: list[str], failed: list[str]) -> None:
        """Count this fault's requeued and failed requests (requeued ids spend one retry; ids
        not requeued now are finished or gone, so their counts are dropped)."""
        self._request_retries = {r: self._request_retries.get(r, 0) + 1 for r in retried}
        self.counters.num_requests_retried += len(retried)
        self.counters.num_requests_failed += len(failed)
        if self._fault_started is not None:
            self.counters.last_detect_seconds = self.clock() - self._fault_started

    def forget_request(self, request_id: str) -> None:
        self._request_retries.pop(request_id, None)

    def next_attempt(self) -> None:
        """Sleep the backoff before the next rebuild; EngineDeadError when no attempt is left."""
        if self.state == DEAD:
            raise EngineDeadError(self.reason)
        max_restarts = int(self.config.max_restarts)
        if len(self._faults) > max_restarts:
            window = float(self.config.restart_window_s)
            self.stop(f"{self.reason.removesuffix('; engine recovering')}; {len(self._faults)} worker faults "
                      f"within {window:.0f}s (recovery.max_restarts={max_restarts}): engine stopped")
            raise EngineDeadError(self.reason)
        delay = min(float(self.config.max_backoff_s), float(self.config.backoff_s) * 2 ** (len(self._faults) - 1))
        self._attempts += 1
        if delay > 0:
            self.sleep(delay)

    def on_attempt_failed(self, exc: BaseException) -> None:
        """A rebuild failed: it counts as one more fault of the window."""
        log.warning("rebuilding the worker group failed (attempt %d): %s", self._attempts, exc)
        self.counters.num_worker_faults += 1
        self._faults.append(self.clock())

    def on_recovered(self) -> float:
        """Serving again; returns the seconds from the fault to now."""
        seconds = self.clock() - (self._fault_started or self.clock())
        self.counters.num_recoveries += 1
        self.counters.recovery_seconds_total += seconds
        self.counters.last_recovery_seconds = seconds
        self.state, self.reason = SERVING, ""
        self._fault_started, self._attempts = None, 0
        log.warning("engine serving again %.1fs after the fault", seconds)
        return seconds

    def stop(self, reason: str) -> None:
        self.state, self.reason = DEAD, reason
        log.error("%s", reason)

    def check_serving(self) -> None:
        """Raise the error a new request gets while the engine is not serving."""
        if self.state == RECOVERING:
            raise EngineRecoveringError(self.reason)
        if self.state == DEAD:
            raise EngineDeadError(self.reason)


# ---- degraded mode -----------------------------------------------------------------------


def compute_degraded_placement(placement, load, num_gpus: int, num_groups: int = 1):
    """A placement of every logical expert over ``num_gpus`` surviving EP ranks.

    placement: the ``balancer.Placement`` in force (phy2log [L, P] over more ranks);
    load: [L, E] recent tokens per logical expert (None or all zero: uniform).
    Each survivor keeps its number of slots (P / R per rank) when that still holds every
    expert at least once (the redundant slots absorb the lost rank's experts), else gets
    ceil(E / num_gpus). Returns a ``Placement`` (phy2log [L, P'], P' = slots x num_gpus).
    """
    import torch

    from balancer import Placement, rebalance_experts

    num_layers, num_experts = placement.num_layers, placement.num_logical
    per_rank = placement.num_physical // placement.num_gpus
    if per_rank * num_gpus < num_experts:
        per_rank = -(-num_experts // num_gpus)
    weight = torch.ones(num_layers, num_experts) if load is None or float(load.sum()) <= 0 else load.float()
    groups = num_groups if num_experts % max(1, num_groups) == 0 else 1
    phy2log, log2phy, logcnt = rebalance_experts(weight, per_rank * num_gpus, groups, 1, num_gpus)
    return Placement(phy2log, log2phy, logcnt, num_gpus)


class EngineRecovery:
    """The engine's side of a worker fault: requeue or fail its requests, then rebuild the
    group, or (``recovery.degraded_mode``, tp = 1, DP > 1) first serve on the surviving ranks
    with every expert re-placed over them while replacements start, and restore the full
    layout once they are up. Mutates ``engine`` (scheduler, placement, balancer, executor)."""

    def __init__(self, engine, config) -> None:
        self.engine = engine
        self.config = config
        self.supervisor = Supervisor(config)
        self.full_placement = None  # the full layout's placement while serving degraded

    @property
    def is_degraded(self) -> bool:
        return self.full_placement is not None

    @property
    def num_missing_ranks(self) -> int:
        """Ranks the group serves without while degraded (0 otherwise)."""
        if not self.is_degraded:
            return 0
        return self.engine.config.parallel.data_parallel_size - self.engine.scheduler.config.dp_size

    def on_worker_fault(self, exc: WorkerFault) -> list:
        """Requeue what may be retried, fail the rest; returns the failed requests' outputs."""
        engine, sup = self.engine, self.supervisor
        sup.on_fault(exc)
        if sup.state == DEAD:  # recovery is off: fail-stop, naming the rank
            raise EngineDeadError(sup.reason) from exc
        retried, failed = engine.scheduler.reset_after_fault(
            engine._new_allocators(engine.scheduler.config.dp_size),
            lambda r: sup.may_retry(r.request_id, sum(s.num_output_tokens for s in r.seqs)))
        sup.on_requests_reset(retried, [o.request_id for o in failed])
        log.warning("after the fault: %d requests requeued, %d failed", len(retried), len(failed))
        return failed

    def recover(self) -> None:
        """Rebuild with backoff until serving; raises EngineDeadError when out of attempts."""
        sup, executor = self.supervisor, self.engine.executor
        if sup.needs_recovery and not hasattr(executor, "restart"):
            sup.stop(f"{sup.reason}: this executor cannot rebuild its workers")
        first = True
        while sup.state != SERVING:
            sup.next_attempt()  # raises EngineDeadError when none is left
            try:
                if not (first and self._degrade()):
                    self._restart()
            except Exception as exc:  # noqa: BLE001 - counted as a fault; the next attempt decides
                sup.on_attempt_failed(exc)
                first = False
                continue
            sup.on_recovered()

    def _restart(self) -> None:
        """The whole group, full layout, with the placement in force (or the full one)."""
        engine = self.engine
        placement = self.full_placement or engine.placement
        engine.executor.restart(placement.phy2log)
        if self.is_degraded:
            self._adopt(placement, engine.config.parallel.data_parallel_size, engine.executor.num_nodes)
            self.full_placement = None

    def _degrade(self) -> bool:
        """Serve on the survivors now; False where degraded mode does not apply."""
        engine = self.engine
        p = engine.config.parallel
        if (not self.config.degraded_mode or self.is_degraded or p.tensor_parallel_size != 1
                or p.data_parallel_size < 2 or not hasattr(engine.executor, "degrade")):
            return False
        lost = engine.executor.find_lost_ranks()
        survivors = p.data_parallel_size - len(lost)
        if not lost or survivors < 1:
            return False
        placement = engine.placement
        if engine.eplb is not None and p.expert_parallel_size > 1:
            load = engine.eplb.stats.logical_load(placement.phy2log) if engine.eplb.stats.num_steps else None
            placement = compute_degraded_placement(placement, load, survivors, engine._num_groups())
        engine.executor.degrade(lost, survivors, placement.phy2log)
        self.full_placement = engine.placement
        self._adopt(placement, survivors, 1)
        log.warning("serving degraded on %d of %d ranks (lost %s) while replacements start",
                    survivors, p.data_parallel_size, lost)
        return True

    def maybe_restore(self) -> list:
        """Once the replacements are up, rebuild the full layout (in-flight requests are
        recomputed, not failed). Returns outputs of requests failed by a fault meanwhile."""
        engine = self.engine
        if not self.is_degraded or not engine.executor.standby_ready():
            return []
        full = engine.config.parallel.data_parallel_size
        engine.scheduler.reset_after_fault(engine._new_allocators(full), lambda r: True)
        try:
            engine.executor.restore(self.full_placement.phy2log)
        except WorkerFault as exc:
            return self.on_worker_fault(exc)
        except Exception as exc:  # noqa: BLE001 - e.g. the rendezvous: rebuild from scratch
            return self.on_worker_fault(WorkerCallError(f"restoring the full layout failed: {exc}"))
        self._adopt(self.full_placement, full, engine.executor.num_nodes)
        self.full_placement = None
        log.warning("full layout restored: %d ranks", full)
        return []

    def _adopt(self, placement, data_parallel_size: int, num_nodes: int) -> None:
        """Driver state for a group of ``data_parallel_size`` DP ranks with ``placement``."""
        engine = self.engine
        counters = engine.eplb.counters if engine.eplb is not None else None
        recorder = engine.eplb.recorder if engine.eplb is not None else None
        engine.placement = placement
        engine.eplb = engine._build_eplb(placement, num_nodes)
        if engine.eplb is not None and counters is not None:
            engine.eplb.counters = counters
            engine.eplb.recorder = recorder  # an expert-distribution record survives the new layout
        if engine.scheduler.config.dp_size != data_parallel_size:
            engine.scheduler.reset_after_fault(engine._new_allocators(data_parallel_size), lambda r: True)
