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
    """A worker raised while executing a method (a broken or timed-out collective, or a bug)."""


class WorkerTimeoutError(WorkerFault, TimeoutError):
    """Ranks did not answer the driver within the call's timeout (a hang outside collectives)."""


class CollectiveError(RuntimeError):
    """Raised inside a worker: a collective did not complete; names the rank and the collective."""


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

    ``on_fault`` records a fault and says whether to rebuild; ``next_attempt`` hands out the
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
        for request_id in retried:
            self._request_retries[request_id] = self._request_retries.get(request_id, 0) + 1
        for request_id in failed:
            self._request_retries.pop(request_id, None)
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
